"""Decoder: a Qwen3 / Llama style transformer in Flax NNX.

Two ways to run it:

* Training / scoring (packed rows):
  `model(tokens, positions, segment_ids, subtree_end=None) -> logits [B, L, V]`
  (fp32). The attention mask is `ac2_jax.losses.attention_mask`, so packed
  segments never see each other and tree rows see only their ancestors.
  `hidden_states` gives the final normed hidden states [B, L, D] and
  `logits` projects any of them (for losses that chunk the vocabulary).

* Sampling with a KV cache (see `Decoder.decode`):
  `cache = model.init_cache(batch, max_len)`, then
  `logits, cache = model.decode(tokens, positions, cache)` for prefill
  (T > 1) and for each step (T = 1). Cache slot p of row b holds the keys and
  values of that row's token at position p; a query at position q attends to
  slots 0..q. Every slot a query can see was written by the row's own
  prefill/steps before it is read, so stale slots of an earlier request never
  leak and rows need no length bookkeeping. Padding tokens take position -1:
  they write nothing and their logits are meaningless.

The shell (embedding, layer loop or scan, remat, final norm, head, LoRA rows, the
cache and the decode step) is `models.skeleton.Transformer`'s; this module is the
family's block (`models.layers.Block` / `block_apply`) and its one attention kind.

Layers: with `config.scan_layers` their params are stacked [num_layers, ...]
(`layers.self_attn.q_proj`, ...) and run under `jax.lax.scan`, else they are
a list (`layers.0.self_attn.q_proj`, ...) run in a Python loop; the math is
the same (`models.layers`). `config.remat` picks what the backward pass
recomputes per layer. `models.stacking` converts between the two layouts;
HF and Orbax I/O accept either.

Compute runs in `config.dtype` (e.g. bfloat16) with weights stored in
`config.param_dtype` (e.g. float32 master weights) and cast at use; norms,
softmax and logits are fp32.

Parameters carry logical axis names (`models.axes`: "vocab", "embed",
"heads", "kv", "mlp", "layers"); `nnx.get_partition_spec(nnx.state(model))`
gives them, and one rules table (`AxisRules`) maps them to mesh axes. Params
are sharded at creation when a mesh is set (`jax.set_mesh`, Auto axis types),
by the active rules; with no mesh everything is plain arrays.
"""

from __future__ import annotations

from flax import nnx

from ac2_jax.models.config import DecoderConfig
from ac2_jax.models.kernels.attention import attention
from ac2_jax.models.layers import Block, apply_rope, block_apply, rope_inv_freq
from ac2_jax.models.skeleton import AttentionKind, KVCache, Run, Transformer

# attention, apply_rope and rope_inv_freq lived here before models.layers and
# models.kernels.attention; KVCache before models.skeleton.
__all__ = ["Decoder", "KVCache", "attention", "apply_rope", "rope_inv_freq"]


class Decoder(Transformer):
    """Embeddings, num_layers x (RMSNorm, GQA attention, RMSNorm, SwiGLU), RMSNorm, lm_head.

    With `tie_embeddings` the lm_head is the embedding matrix; with `sliding_window`
    every layer is windowed (Mistral).
    """

    config: DecoderConfig
    layers: Block | nnx.List

    def build_layer(self, config, rngs, stack, count=None):
        return Block(config, rngs, stack=count)

    def block(self, stack: str, w: dict, x, rope, mask, run: Run, cache=None, inputs=None):
        x, cache = block_apply(self.config, w, x, rope, mask, run.backend, cache, run.lora)
        return x, cache, None

    def attention_kinds(self) -> tuple[AttentionKind, ...]:
        return (AttentionKind(self.config.sliding_window, rope_inv_freq(self.config)),)
