"""Gemma 3 text decoder (HF `Gemma3ForCausalLM`, model_type "gemma3_text") in Flax NNX.

What differs from `Decoder` (the math of transformers' `modeling_gemma3.py`):

* RMSNorm scales by (1 + w), in fp32, then casts (weights start at zero);
  four per layer: input, post_attention (on the attention's output, before
  the residual add), pre_feedforward, post_feedforward (on the MLP's output).
* Embeddings are multiplied by sqrt(hidden_size) (cast to the embedding's
  dtype first, as HF does); the head is tied by default.
* MLP: down(gelu_tanh(gate x) * up x).
* Attention: per-head q/k RMSNorm (the (1 + w) kind), scores scaled by
  query_pre_attn_scalar ** -0.5 (folded into q's norm weight here, so the
  shared kernels' 1/sqrt(head_dim) gives it: RoPE is linear, the scale
  commutes with it).
* Layers are "sliding_attention" (a query at position p sees keys at
  positions > p - sliding_window of its segment; RoPE base `rope_local_theta`)
  or "full_attention" (causal; RoPE base `rope_theta` with `rope_scaling`,
  None or "linear"), per `layer_types`.

The projections, q/k norms, RoPE, the KV cache and LoRA adapters are
`models.layers`' (`attention_apply`, `_proj` / `_adapted`, `MLP`,
`_add_lora`), run with the `Gemma3Config` (a `ModelConfig`). The shell
(scaled embedding, layer loop or scan, remat, final norm, head, LoRA rows,
cache, decode) is `models.skeleton.Transformer`'s; Gemma 3 gives it two
attention kinds, sliding (kind 0) and full (kind 1): the per-layer window and
RoPE choice are data (each layer's kind, an int scanned beside the stacked
params under `scan_layers`).

KV cache: `init_cache` gives a `HybridCache` (`models.skeleton`), the
sliding layers' `KVCache` (past `sliding_window` positions a ring of W slots
per row, so its memory stays at the window however long the sequence grows)
and the full layers' (max_len slots), each in the model's layout. `decode`
has the skeleton's decode contract (`Transformer.decode_with_outputs`).

The config and its `config.json` mapping are `models.gemma3_config`'s.
Not supported (refused by name there): logit / attention soft-capping
(Gemma 2's; null in every Gemma 3), bidirectional attention, attention
biases, another activation, RoPE types other than default / linear, and
`mlp_backward="custom"` (that custom VJP is SwiGLU's). The multimodal
`Gemma3ForConditionalGeneration` checkpoints (model_type "gemma3") are no
family here.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ac2_jax.models.config import ModelConfig
from ac2_jax.models.family import ModelFamily, register_family
from ac2_jax.models.gemma3_config import (
    Gemma3Config,
    gemma3_config_from_hf,
    gemma3_hf_config,
    rope_inv_freqs,
)
from ac2_jax.models.layers import (
    MLP,
    Attention,
    RMSNorm,
    _adapted,
    _dot,
    _zeros,
    attention_apply,
    from_bits,
)
from ac2_jax.models.skeleton import AttentionKind, HybridCache, KVCache, Run, Transformer

__all__ = ["Gemma3", "Gemma3Config", "Gemma3Family", "HybridCache"]


# ----------------------------------------------------------------------------- pure pieces


def gemma_norm(weight: jax.Array, x: jax.Array, eps: float, dtype) -> jax.Array:
    """x / rms(x) * (1 + weight) over the last axis, in fp32, then cast (HF's Gemma3RMSNorm)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(dtype)


def _attention(c: Gemma3Config, w: dict, x, rope, mask, backend, cache, lora):
    """Gemma's attention through `layers.attention_apply`: its q/k norm weights become
    (1 + w), q's times sqrt(head_dim / query_pre_attn_scalar) (the kernels divide
    scores by sqrt(head_dim))."""
    s = math.sqrt(c.head_dim / float(c.query_pre_attn_scalar))
    qn = (1.0 + w["q_norm"]["weight"].astype(jnp.float32)) * s
    kn = 1.0 + w["k_norm"]["weight"].astype(jnp.float32)
    view = {**w, "q_norm": {"weight": qn}, "k_norm": {"weight": kn}}
    return attention_apply(c, view, x, rope, mask, backend, cache, lora)


def mlp_apply(v: ModelConfig, w: dict, x: jax.Array, lora=None) -> jax.Array:
    """down(gelu_tanh(gate x) * up x), each projection plus its LoRA delta if it has one."""
    dt = v.dtype
    x = x.astype(dt)
    g = _adapted(v, _dot(x, w["gate_proj"], dt), x, w, "gate", lora)
    u = _adapted(v, _dot(x, w["up_proj"], dt), x, w, "up", lora)
    h = jax.nn.gelu(g, approximate=True) * u
    return _adapted(v, _dot(h, w["down_proj"], dt), h, w, "down", lora)


def block_apply(c: Gemma3Config, w: dict, x, rope, mask, backend, cache, lora):
    """One Gemma 3 layer: x + post_norm(attn(norm x)), then + post_ff_norm(mlp(pre_ff_norm x)).
    Returns (x, cache) (`layers.attention_apply`'s cache contract)."""
    eps, dt, w = c.rms_eps, c.dtype, from_bits(c, w)
    h = gemma_norm(w["input_layernorm"]["weight"], x, eps, dt)
    a, cache = _attention(c, w["self_attn"], h, rope, mask, backend, cache, lora)
    x = x + gemma_norm(w["post_attention_layernorm"]["weight"], a, eps, dt)
    h = gemma_norm(w["pre_feedforward_layernorm"]["weight"], x, eps, dt)
    m = mlp_apply(c, w["mlp"], h, lora)
    return x + gemma_norm(w["post_feedforward_layernorm"]["weight"], m, eps, dt), cache


# ----------------------------------------------------------------------------- modules


class Norm(RMSNorm):
    """Gemma's RMSNorm weight [dim] ([stack, dim] when stacked), zero at init (scale 1 + w)."""

    INIT = staticmethod(_zeros)

    def __call__(self, x: jax.Array) -> jax.Array:
        return gemma_norm(self.weight[...], x, self.eps, self.dtype)


class Block(nnx.Module):
    """One layer's params (HF names), or `stack` layers' stacked on a leading axis."""

    def __init__(self, c: Gemma3Config, rngs: nnx.Rngs, stack: int | None = None):
        D, eps, dt, pd = c.hidden_size, c.rms_eps, c.dtype, c.base_dtype
        self.input_layernorm = Norm(D, eps, dt, pd, stack)
        self.self_attn = Attention(c, rngs, stack, norm=Norm)  # q/k norms: Gemma's
        self.post_attention_layernorm = Norm(D, eps, dt, pd, stack)
        self.pre_feedforward_layernorm = Norm(D, eps, dt, pd, stack)
        self.mlp = MLP(c, rngs, stack)
        self.post_feedforward_layernorm = Norm(D, eps, dt, pd, stack)


class Gemma3(Transformer):
    """Scaled embeddings, num_layers x Gemma 3 layer, Norm, head (tied by default).

    Meets `models.family.CausalLM` for packed rows and has `Decoder`'s cache
    API (`init_cache`, `decode`; its cache a `HybridCache`); param names and
    layouts as `Decoder`'s (`layers.{i}.self_attn.q_proj` ..., stacked under
    `scan_layers`), so `hf_io`, `stacking` and `peft_io` read and write it.
    """

    config: Gemma3Config
    layers: Block | nnx.List
    NORM = Norm

    def build_layer(self, config, rngs, stack, count=None):
        return Block(config, rngs, stack=count)

    def block(self, stack: str, w: dict, x, rope, mask, run: Run, cache=None, inputs=None):
        x, cache = block_apply(self.config, w, x, rope, mask, run.backend, cache, run.lora)
        return x, cache, None

    def embed_scale(self) -> float:
        """sqrt(hidden_size) (in the embedding's dtype, as HF rounds it)."""
        return self.config.hidden_size**0.5

    def attention_kinds(self) -> tuple[AttentionKind, ...]:
        """Sliding (kind 0: the window, RoPE base rope_local_theta) and full (kind 1:
        causal, RoPE base rope_theta with its scaling)."""
        local, glob = rope_inv_freqs(self.config)
        return AttentionKind(self.config.sliding_window, local), AttentionKind(None, glob)

    def layer_kind(self, i: int) -> int:
        return 0 if self.config.sliding[i] else 1

    def cache_from_parts(self, parts: tuple[KVCache | None, ...]) -> HybridCache:
        return HybridCache(sliding=parts[0], full=parts[1])

    def cache_parts(self, cache: Any) -> tuple[KVCache | None, ...]:
        if not isinstance(cache, HybridCache):
            raise ValueError(
                f"decode: Gemma3 takes a HybridCache (sliding and full layers' caches), got "
                f"{type(cache).__name__}; build it with model.init_cache"
            )
        return cache.sliding, cache.full


@register_family("gemma3_text")
class Gemma3Family(ModelFamily):
    """Gemma 3's text decoder (`Gemma3ForCausalLM`): `Gemma3` of a `Gemma3Config`."""

    hf_architecture = "Gemma3ForCausalLM"
    config_class = Gemma3Config

    def build(self, config: Gemma3Config, rngs: nnx.Rngs) -> Gemma3:
        return Gemma3(config, rngs=rngs)

    def config_from_hf(self, hf: dict[str, Any], **kwargs: Any) -> Gemma3Config:
        return gemma3_config_from_hf(hf, **kwargs)

    def config_to_hf(self, config: Gemma3Config) -> dict[str, Any]:
        return gemma3_hf_config(config)
