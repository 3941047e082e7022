"""Real-size presets: Qwen3-0.6B and Qwen3-1.7B shapes, random weights, no download.

`experiments.real_size.checkpoint.write_random_checkpoint(cfg.shape, path)` builds the
model from transformers' own `Qwen3Config(**cfg.shape)` with random weights
and saves it as HF safetensors; `experiments.real_size.load_preset(cfg,
path)` loads it as a Decoder with `cfg.model`'s dtypes and runtime choices.

Sections: shape -> `transformers.Qwen3Config` keyword arguments (the numbers
of the Qwen/Qwen3-0.6B and Qwen/Qwen3-1.7B config.json: vocabulary 151,936,
16 query heads and 8 KV heads of 128, 28 layers, RoPE theta 1e6, tied
embeddings); model -> the DecoderConfig dtypes and runtime fields
(`RUNTIME_FIELDS`); train / sample -> the sequence-length, rows and remat
plan for the machine the variant is for (estimates in the comments; the
measured figures are in docs/notes/2026-12-02-qwen3-06b-policy-on-2-cores.md and the later
real-size notes).

Memory arithmetic behind the plans (fp32 = 4 bytes per value):
  params  0.6B: 596M (155.6M of them the tied embedding); 1.7B: 1.72B (311M).
  train state = params + grads + AdamW mu, nu in fp32 = 16 bytes / param:
          0.6B 9.5 GB, 1.7B 27.5 GB.
  activations with scan_layers + remat="full": each layer keeps only its
          input [tokens, D] (0.6B: 4 KB / token / layer, 112 KB / token over
          28 layers) plus one layer's recomputation at a time; "save_dots"
          also keeps the weight-matmul outputs (0.6B: ~12.3K values / token /
          layer, 1.7B ~20.5K). Attention is block-sparse or a fused kernel,
          so no [L, L] scores are held.
  logits  [tokens, 151,936] fp32 is 0.6 MB / token (2.5 GB at 4,096 tokens,
          the same again for its gradient) unless the loss chunks the
          vocabulary (the losses' chunked log-probs).
  KV cache per token: 28 layers x 2 x 8 heads x 128 = 57,344 values
          (224 KB fp32, 112 KB bf16).

Variants (`--config=experiments/real_size/qwen3.py:1.7b_gpu`):
  default   Qwen3-0.6B on a 24 GiB CPU box (train and sample)
  1.7b      Qwen3-1.7B on a 24 GiB CPU box: sampling / scoring only
  0.6b_gpu  Qwen3-0.6B on one 80-141 GB GPU (bf16 compute, fp32 master)
  1.7b_gpu  Qwen3-1.7B on one 80-141 GB GPU
  tiny      the same family at test size (for tests and smoke runs)
"""

import ml_collections

from ac2_jax.config import select_variant
from ac2_jax.models.presets import shape_kwargs

# The shapes are the library's (ac2_jax.models.presets: the published config.json fields).
QWEN3_0_6B = shape_kwargs("qwen3-0.6b")[1]
QWEN3_1_7B = shape_kwargs("qwen3-1.7b")[1]


def _default(c):
    return c


def _cpu_1_7b(c):
    c.shape = ml_collections.ConfigDict(QWEN3_1_7B)
    # 27.5 GB of fp32 train state does not fit 24 GiB: no train plan (the section is
    # removed). Scoring (no grads) at 4,096 tokens: 6.9 GB of params + chunked logits.
    del c["train"]
    # 8 rows x 4,096 slots x 224 KiB = 7.0 GiB of fp32 cache next to 6.9 GB of params.
    c.sample.update(batch=8, max_len=4096)
    return c


def _gpu(c, shape):
    c.shape = ml_collections.ConfigDict(shape)
    # bf16 activations and KV cache, fp32 master weights and AdamW moments; cuDNN
    # flash attention ("auto" on GPU for bf16 packed rows).
    c.model.update(dtype="bfloat16", param_dtype="float32", remat="save_dots")
    return c


def _gpu_0_6b(c):
    c = _gpu(c, QWEN3_0_6B)
    # 9.5 GB state; save_dots keeps ~24.6 KB / token / layer in bf16 (0.7 MB / token):
    # 4 rows x 8,192 = 32K tokens -> ~22 GB, fits 80 GB with chunked logits.
    c.train.update(seq_len=8192, rows=4)
    # 64 rows x 8,192 slots x 112 KiB (bf16) = 60 GB of cache: fits a 141 GB H200 next
    # to the learner; on an 80 GB card use batch 32.
    c.sample.update(batch=64, max_len=8192)
    return c


def _gpu_1_7b(c):
    c = _gpu(c, QWEN3_1_7B)
    # 27.5 GB state; save_dots ~41 KB / token / layer in bf16 (1.15 MB / token):
    # 2 rows x 8,192 = 16K tokens -> ~19 GB on 80 GB; on 141 GB rows=4 (~38 GB),
    # or remat="full" (~0.1 MB / token) for 4 rows on 80 GB.
    c.train.update(seq_len=8192, rows=2)
    c.sample.update(batch=32, max_len=8192)  # 30 GB of bf16 cache
    return c


def _tiny(c):
    c.shape = ml_collections.ConfigDict(dict(
        QWEN3_0_6B, vocab_size=512, hidden_size=32, intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=1024))
    c.train.update(seq_len=128, rows=2)
    c.sample.update(batch=2, max_len=128)
    return c


VARIANTS = {"default": _default, "1.7b": _cpu_1_7b, "0.6b_gpu": _gpu_0_6b,
            "1.7b_gpu": _gpu_1_7b, "tiny": _tiny}


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    apply = select_variant(variant, VARIANTS)
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.shape = ml_collections.ConfigDict(QWEN3_0_6B)   # transformers.Qwen3Config kwargs
    # DecoderConfig dtypes and runtime fields. On CPU: fp32 (XLA:CPU has no fast bf16
    # matmuls), layers scanned (compile time independent of depth), remat "full"
    # (the 24 GiB box cannot keep per-layer activations at 4K tokens), attention
    # "auto" = block-sparse for rows of >= 512 tokens.
    c.model = ml_collections.ConfigDict(dict(
        dtype="float32", param_dtype="float32", scan_layers=True, remat="full",
        attention_backend="auto", attention_block=128))
    # Train plan, 24 GiB CPU, Qwen3-0.6B: 9.5 GB of state; at 4,096 tokens per row the
    # remat="full" layer inputs are 0.46 GB and one layer's recomputation ~0.3 GB (x2-3
    # for backward temporaries); logits must be chunked (2 x 2.5 GB otherwise). One row
    # per micro-batch; more rows through grad_accum.
    c.train = ml_collections.ConfigDict(dict(seq_len=4096, rows=1, grad_accum=1))
    # Sampling plan: 8 rows x 4,096 slots x 224 KiB (fp32) = 7.0 GiB of KV cache.
    c.sample = ml_collections.ConfigDict(dict(batch=8, max_len=4096))
    return apply(c)
