"""Kernels: the attention implementations behind one function and the experts' grouped
matmul, below the model families (a family calls `attention.attention`; nothing here
imports a family). `ac2_jax.models` exports what a user calls (`attention`); import the
rest from its module.

- `attention`: `attention(q, k, v, mask, backend=...)`, the one entry point, and the
  backend choice (`ATTENTION_BACKENDS`, `choose_backend`, `target_platform`); the dense
  reference (`dense_attention`).
- `attention_mask`: `AttentionMask`, the packed-row / tree / window / decode mask every
  backend reads (`visible`, `NEG`, `BIG`).
- `blocksparse`: flash-style tiles that skip fully masked blocks (CPU, any platform).
- `attention_accel`: cuDNN, Pallas GPU and splash (TPU) through JAX's own kernels.
- `attention_tpu`: this library's Pallas TPU kernels (tree-packed rows).
- `gmm`: the experts' grouped GEMM on TPU (Pallas megablox `gmm`).
"""
