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
`_add_lora`), run with `Gemma3Config.layer_config()`, the `DecoderConfig`
view of one layer's shape. The per-layer window and RoPE choice are data (a
flag per layer, scanned beside the stacked params under `scan_layers`): a
windowed `AttentionMask` whose positions are zeroed on full layers is the
full mask; dense masks and RoPE tables are picked with `jnp.where`.

KV cache (`models.gemma3_cache`): `init_cache` gives a `HybridCache`, the
sliding layers' `KVCache` (past `sliding_window` positions a ring of W slots
per row, so its memory stays at the window however long the sequence grows)
and the full layers' (max_len slots), each in the model's layout. `decode`
has `Decoder.decode`'s contract.

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

from ac2_jax.losses import LMHead
from ac2_jax.models.config import DecoderConfig
from ac2_jax.models.decoder import _POLICIES, _check_2d, add_head, embedding
from ac2_jax.models.family import ModelFamily, register_family
from ac2_jax.models.gemma3_cache import HybridCache, check_cache, init_hybrid_cache, run_cached
from ac2_jax.models.gemma3_config import (
    Gemma3Config,
    gemma3_config_from_hf,
    gemma3_hf_config,
    rope_inv_freqs,
)
from ac2_jax.models.kernels.attention import choose_backend
from ac2_jax.models.kernels.attention_mask import AttentionMask
from ac2_jax.models.layers import (
    MLP,
    _adapted,
    _add_lora,
    _dot,
    _param,
    _zeros,
    attention_apply,
    from_bits,
    layer_params,
    rope_cos_sin,
)
from ac2_jax.models.lora import LoRAScale

__all__ = ["Gemma3", "Gemma3Config", "Gemma3Family"]


# ----------------------------------------------------------------------------- pure pieces


def gemma_norm(weight: jax.Array, x: jax.Array, eps: float, dtype) -> jax.Array:
    """x / rms(x) * (1 + weight) over the last axis, in fp32, then cast (HF's Gemma3RMSNorm)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(dtype)


def _attention(c: Gemma3Config, v: DecoderConfig, w: dict, x, rope, mask, backend, cache, lora):
    """Gemma's attention through `layers.attention_apply`: its q/k norm weights become
    (1 + w), q's times sqrt(head_dim / query_pre_attn_scalar) (the kernels divide
    scores by sqrt(head_dim))."""
    s = math.sqrt(c.head_dim / float(c.query_pre_attn_scalar))
    qn = (1.0 + w["q_norm"]["weight"].astype(jnp.float32)) * s
    kn = 1.0 + w["k_norm"]["weight"].astype(jnp.float32)
    view = {**w, "q_norm": {"weight": qn}, "k_norm": {"weight": kn}}
    return attention_apply(v, view, x, rope, mask, backend, cache, lora)


def mlp_apply(v: DecoderConfig, w: dict, x: jax.Array, lora=None) -> jax.Array:
    """down(gelu_tanh(gate x) * up x), each projection plus its LoRA delta if it has one."""
    dt = v.dtype
    x = x.astype(dt)
    g = _adapted(v, _dot(x, w["gate_proj"], dt), x, w, "gate", lora)
    u = _adapted(v, _dot(x, w["up_proj"], dt), x, w, "up", lora)
    h = jax.nn.gelu(g, approximate=True) * u
    return _adapted(v, _dot(h, w["down_proj"], dt), h, w, "down", lora)


def block_apply(c: Gemma3Config, v: DecoderConfig, w: dict, x, rope, mask, backend, cache, lora):
    """One Gemma 3 layer: x + post_norm(attn(norm x)), then + post_ff_norm(mlp(pre_ff_norm x)).
    Returns (x, cache) (`layers.attention_apply`'s cache contract)."""
    eps, dt, w = c.rms_eps, c.dtype, from_bits(v, w)
    h = gemma_norm(w["input_layernorm"]["weight"], x, eps, dt)
    a, cache = _attention(c, v, w["self_attn"], h, rope, mask, backend, cache, lora)
    x = x + gemma_norm(w["post_attention_layernorm"]["weight"], a, eps, dt)
    h = gemma_norm(w["pre_feedforward_layernorm"]["weight"], x, eps, dt)
    m = mlp_apply(v, w["mlp"], h, lora)
    return x + gemma_norm(w["post_feedforward_layernorm"]["weight"], m, eps, dt), cache


def _pick(flag, sliding, full):
    """The sliding layer's (mask or RoPE tables) where `flag`, else the full layer's.

    flag: a Python bool (layers in a loop) or a traced bool (under scan). A
    windowed AttentionMask becomes the full one by zeroing its positions (the
    window compares position differences), so blocked kernels keep one mask
    structure for every layer."""
    if isinstance(flag, bool):
        return sliding if flag else full
    if sliding is full:
        return full
    if isinstance(sliding, AttentionMask):
        f = flag.astype(jnp.int32)
        return sliding.replace(q_pos=sliding.query_pos * f, kv_pos=sliding.key_pos * f)
    return jax.tree.map(lambda s, a: jnp.where(flag, s, a), sliding, full)


# ----------------------------------------------------------------------------- modules


class Norm(nnx.Module):
    """Gemma's RMSNorm weight [dim] ([stack, dim] when stacked), zero at init (scale 1 + w)."""

    def __init__(self, dim: int, eps: float, dtype, param_dtype, stack: int | None = None):
        self.eps, self.dtype = eps, dtype
        self.weight = _param(None, _zeros, (dim,), param_dtype, (None,), stack)

    def __call__(self, x: jax.Array) -> jax.Array:
        return gemma_norm(self.weight[...], x, self.eps, self.dtype)


class Attention(nnx.Module):
    """q/k/v/o projections ([in, out]), q/k norms (Gemma's), LoRA adapters per config."""

    def __init__(self, c: Gemma3Config, rngs: nnx.Rngs, stack: int | None = None):
        v = c.layer_config()
        init = nnx.initializers.normal(c.initializer_range)
        D, H, K, hd, pd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.base_dtype
        shapes = {
            "q": (D, H * hd, ("embed", "heads")),
            "k": (D, K * hd, ("embed", "kv")),
            "v": (D, K * hd, ("embed", "kv")),
            "o": (H * hd, D, ("heads", "embed")),
        }
        for name, (n_in, n_out, names) in shapes.items():
            setattr(self, f"{name}_proj", _param(rngs, init, (n_in, n_out), pd, names, stack))
        self.q_norm = Norm(hd, c.rms_eps, c.dtype, pd, stack)
        self.k_norm = Norm(hd, c.rms_eps, c.dtype, pd, stack)
        _add_lora(self, v, rngs, shapes, stack)


class Block(nnx.Module):
    """One layer's params (HF names), or `stack` layers' stacked on a leading axis."""

    def __init__(self, c: Gemma3Config, rngs: nnx.Rngs, stack: int | None = None):
        D, eps, dt, pd = c.hidden_size, c.rms_eps, c.dtype, c.base_dtype
        self.input_layernorm = Norm(D, eps, dt, pd, stack)
        self.self_attn = Attention(c, rngs, stack)
        self.post_attention_layernorm = Norm(D, eps, dt, pd, stack)
        self.pre_feedforward_layernorm = Norm(D, eps, dt, pd, stack)
        self.mlp = MLP(c.layer_config(), rngs, stack)
        self.post_feedforward_layernorm = Norm(D, eps, dt, pd, stack)


class Gemma3(nnx.Module):
    """Scaled embeddings, num_layers x Gemma 3 layer, Norm, head (tied by default).

    Meets `models.family.CausalLM` for packed rows and has `Decoder`'s cache
    API (`init_cache`, `decode`); param names and layouts as `Decoder`'s
    (`layers.{i}.self_attn.q_proj` ..., stacked under `scan_layers`), so
    `hf_io`, `stacking` and `peft_io` read and write it.
    """

    norm: nnx.Module  # set by `decoder.add_head`, as lm_head (untied) and lora_scale
    lm_head: nnx.Param
    lora_scale: LoRAScale

    def __init__(self, config: Gemma3Config, rngs: nnx.Rngs | None = None):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        c = self.config = config
        self.embed_tokens = embedding(c, rngs)
        self.layers: Block | nnx.List
        if c.scan_layers:
            self.layers = Block(c, rngs, stack=c.num_layers)
        else:
            self.layers = nnx.List([Block(c, rngs) for _ in range(c.num_layers)])
        add_head(self, c, rngs, Norm(c.hidden_size, c.rms_eps, c.dtype, c.base_dtype))

    # -- shared pieces

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, L] -> [B, L, D] times sqrt(hidden_size) (in the embedding's dtype, as
        HF rounds it), in the compute dtype."""
        table = self.embed_tokens[...]
        scale = jnp.asarray(self.config.hidden_size**0.5, jnp.float32).astype(table.dtype)
        return (jnp.take(table, tokens, axis=0) * scale).astype(self.config.dtype)

    def head(self) -> LMHead:
        """The output projection: the embedding [V, D] when tied, else lm_head [D, V]."""
        if self.config.tie_embeddings:
            return LMHead(self.embed_tokens[...], "vd")
        return LMHead(self.lm_head[...], "dv")

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final hidden states [..., D] -> fp32 logits [..., V] (`head().logits`)."""
        return self.head().logits(hidden)

    def _backend(self, kind: str, q_len: int) -> str:
        c = self.config
        backend = choose_backend(
            c.attention_backend,
            kind=kind,
            q_len=q_len,
            dtype=c.dtype,
            head_dim=c.head_dim,
            block=c.attention_block,
        )
        if c.windowed and backend in ("pallas_gpu", "splash_tpu", "pallas_tpu"):
            return "dense"  # they take no window
        return backend

    def _ropes(self, positions: jax.Array):
        """(local, global) `rope_cos_sin` tables of positions [B, L]."""
        local, glob = rope_inv_freqs(self.config)
        return tuple(rope_cos_sin(positions, jnp.asarray(f)) for f in (local, glob))

    def _lora_rows(self, adapter_ids: jax.Array | None, batch: int):
        c = self.config
        if c.lora is None or c.lora.slots is None:
            if adapter_ids is not None:
                raise ValueError(
                    "Gemma3: adapter_ids given, but the model has no adapter bank "
                    "(Gemma3Config.lora.slots)"
                )
            return None
        ids = jnp.zeros((batch,), jnp.int32) if adapter_ids is None else adapter_ids
        ids = ids.astype(jnp.int32)
        return ids, jnp.take(self.lora_scale[...], ids, axis=0)

    def _run_layers(self, x, ropes, masks, backend, lora):
        """All layers over packed rows x (no cache); the sliding / full mask and RoPE
        picked per layer (`_pick`)."""
        c, v = self.config, self.config.layer_config()
        params = layer_params(v, self.layers)
        flags = c.sliding

        def layer(w, x, rope, mask):
            return block_apply(c, v, w, x, rope, mask, backend, None, lora)[0]

        if c.remat != "none":
            layer = jax.checkpoint(
                layer, policy=_POLICIES[str(c.remat)], prevent_cse=not c.scan_layers
            )
        if c.scan_layers:

            def body(x, xs):
                w, flag = xs
                return layer(w, x, _pick(flag, *ropes), _pick(flag, *masks)), None

            return jax.lax.scan(body, x, (params, jnp.asarray(flags)))[0]
        for i in range(c.num_layers):
            x = layer(params[i], x, _pick(flags[i], *ropes), _pick(flags[i], *masks))
        return x

    def _masks(self, full: AttentionMask, sliding: AttentionMask, backend: str):
        """(sliding, full) masks in the form the backend takes (the same object twice when
        no layer is windowed)."""
        if backend == "dense":
            d_full = full.dense()
            return (d_full if sliding is full else sliding.dense()), d_full
        return sliding, full

    # -- training / scoring

    def hidden_states(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        subtree_end: jax.Array | None = None,
        adapter_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Final normed hidden states [B, L, D] of packed rows (see `__call__`)."""
        _check_2d(tokens=tokens, positions=positions, segment_ids=segment_ids)
        c = self.config
        lora = self._lora_rows(adapter_ids, tokens.shape[0])
        backend = self._backend("flat" if subtree_end is None else "tree", tokens.shape[1])
        full = AttentionMask.packed(segment_ids, subtree_end)
        sliding = full
        if c.windowed:
            sliding = AttentionMask.packed(
                segment_ids, subtree_end, positions=positions, window=c.sliding_window
            )
        masks = self._masks(full, sliding, backend)
        x = self._run_layers(self.embed(tokens), self._ropes(positions), masks, backend, lora)
        return self.norm(x)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        subtree_end: jax.Array | None = None,
        adapter_ids: jax.Array | None = None,
    ) -> jax.Array:
        """fp32 logits [B, L, V] of packed rows: tokens, positions (restarting per
        segment: a window counts from the segment's start), segment_ids (0 =
        padding), subtree_end (tree rows) [B, L] int; adapter_ids [B]: each
        row's adapter-bank slot."""
        return self.logits(
            self.hidden_states(tokens, positions, segment_ids, subtree_end, adapter_ids)
        )

    # -- sampling with a KV cache

    def init_cache(self, batch: int, max_len: int, dtype=None) -> HybridCache:
        """An empty cache for `batch` rows of up to `max_len` positions: the sliding
        layers' a ring of `sliding_window` slots when max_len is longer, the full
        layers' max_len slots (`models.gemma3_cache`). dtype: default the compute dtype."""
        dt = self.config.dtype if dtype is None else dtype
        return init_hybrid_cache(self.config, batch, max_len, dt)

    def decode(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: HybridCache,
        *,
        logits_at: jax.Array | None = None,
        adapter_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, HybridCache]:
        """T new tokens per row against the cache: prefill (T > 1) or a step (T = 1).

        `Decoder.decode`'s contract: positions [B, T] (-1: padding, writes
        nothing; >= max_len: dropped); a row's positions are contiguous over its
        calls (0.. for a new request). Query (b, t) sees positions 0..positions[b, t]
        of row b, and on sliding layers only those within the window (which their
        ring holds; a chunk longer than the window attends over the ring as it was
        plus its own keys). Returns (fp32 logits [B, T, V], or [B, V] at
        `logits_at` [B], new cache). adapter_ids [B]: adapter-bank slots.
        """
        _check_2d(tokens=tokens, positions=positions)
        c = self.config
        check_cache(c, cache, tokens.shape[0])
        positions = positions.astype(jnp.int32)
        backend = self._backend("decode", tokens.shape[1])
        lora = self._lora_rows(adapter_ids, tokens.shape[0])
        v = c.layer_config()

        def layer(w, x, rope, mask, kv):
            return block_apply(c, v, w, x, rope, mask, backend, kv, lora)

        params = layer_params(v, self.layers)
        ropes = self._ropes(jnp.maximum(positions, 0))
        x, cache = run_cached(
            layer, c, params, self.embed(tokens), ropes, positions, cache, backend
        )
        x = self.norm(x)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at.astype(jnp.int32)[:, None, None], axis=1)[:, 0]
        return self.logits(x), cache


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
