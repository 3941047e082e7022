"""Decoder: a Qwen3 / Llama style transformer in Flax NNX (the dense family).

The shell (embedding, layer loop or scan, remat, final norm, head, LoRA rows,
the KV cache and the decode step) is `models.skeleton.Transformer`'s, and so
are the contracts of training / scoring (`Transformer.forward`, `__call__`:
packed rows -> fp32 logits [B, L, V]) and of sampling with a KV cache
(`init_cache`, `Transformer.decode_with_outputs`): see its module doc. This
module is the family's part: its block (`models.layers.Block` /
`block_apply`: RMSNorm, GQA attention, RMSNorm, SwiGLU) and its one attention
kind (`sliding_window` windows every layer: Mistral).

Layers: with `config.scan_layers` their params are stacked [num_layers, ...]
(`layers.self_attn.q_proj`, ...), else a list (`layers.0.self_attn.q_proj`,
...); `models.stacking` converts between the two layouts, and HF and Orbax
I/O accept either.

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
