"""Decoder: a Qwen3 / Llama style transformer in Flax NNX.

Two ways to run it:

* Training / scoring (packed rows):
  `model(tokens, positions, segment_ids, subtree_end=None) -> logits [B, L, V]`
  (fp32). The attention mask is `ac2_jax.losses.attention_mask`, so packed
  segments never see each other and tree rows see only their ancestors.

* Sampling with a KV cache (see `Decoder.decode`):
  `cache = model.init_cache(batch, max_len)`, then
  `logits, cache = model.decode(tokens, positions, cache)` for prefill
  (T > 1) and for each step (T = 1). Cache slot p of row b holds the keys and
  values of that row's token at position p; a query at position q attends to
  slots 0..q. Every slot a query can see was written by the row's own
  prefill/steps before it is read, so stale slots of an earlier request never
  leak and rows need no length bookkeeping. Padding tokens take position -1:
  they write nothing and their logits are meaningless.

Parameters carry sharding names over the mesh axes ('data', 'fsdp',
'tensor'): `nnx.get_partition_spec(nnx.state(model))` gives their
PartitionSpecs. Params are sharded at creation only when a mesh with those
axes is set (`jax.set_mesh`, Auto axis types); with no mesh everything is
plain arrays.
Weights are stored [in, out] (HF stores [out, in]; `hf_io` transposes).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from ac2_jax.losses import attention_mask
from ac2_jax.models.config import DecoderConfig

_NEG = -1e30  # finite, so a query that sees nothing gets a uniform softmax, not NaN


def _param(rngs: nnx.Rngs | None, init, shape, dtype, names) -> nnx.Param:
    """A Param annotated with mesh axis names; sharded now only if a mesh has them."""
    value = init(rngs.params() if rngs is not None else None, shape, dtype)
    mesh = jax.sharding.get_abstract_mesh()
    eager = (not mesh.empty) and all(n is None or n in mesh.axis_names for n in names)
    return nnx.Param(value, out_sharding=names, eager_sharding=eager)


def _ones(_key, shape, dtype):
    return jnp.ones(shape, dtype)


# ----------------------------------------------------------------------------- pure pieces

def rope_inv_freq(config: DecoderConfig) -> np.ndarray:
    """Inverse RoPE frequencies [head_dim // 2] (HF default, or llama3 scaling)."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    sc = config.rope_scaling
    if sc is not None and sc.get("rope_type", sc.get("type")) == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old / lo, old / hi
        scaled = np.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF convention). x [B, L, H, hd], positions [B, L]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, L, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked grouped-query attention; the one place a blocked kernel would go.

    q [B, L, H, hd]; k, v [B, S, K, hd] with H a multiple of K; mask [B, L, S]
    bool (True = may attend). Softmax in fp32. Returns [B, L, H, hd].
    """
    B, L, H, hd = q.shape
    K = k.shape[2]
    qg = q.reshape(B, L, K, H // K, hd)
    if L == 1 and jax.default_backend() == "cpu":
        return _decode_step_attention(qg, k, v, mask, hd).reshape(B, L, H, hd)
    scores = jnp.einsum("blkgd,bskd->bkgls", qg, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(hd)
    scores = jnp.where(mask[:, None, None, :, :], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgls,bskd->blkgd", probs, v)
    return out.reshape(B, L, H, hd)


def _decode_step_attention(qg, k, v, mask, hd):
    """One query per row (sampling): broadcast-multiply instead of a batched
    einsum, about 4x faster on XLA:CPU at batch 16 (same values)."""
    q1 = qg[:, 0].astype(jnp.float32)                       # [B, K, G, hd]
    kt = jnp.swapaxes(k, 1, 2).astype(jnp.float32)          # [B, K, S, hd]
    scores = (q1[:, :, :, None, :] * kt[:, :, None]).sum(-1) / math.sqrt(hd)  # [B, K, G, S]
    scores = jnp.where(mask[:, 0][:, None, None, :], scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1)
    vt = jnp.swapaxes(v, 1, 2).astype(jnp.float32)          # [B, K, S, hd]
    out = (probs[..., None] * vt[:, :, None]).sum(-2)       # [B, K, G, hd]
    return out[:, None].astype(v.dtype)


# ----------------------------------------------------------------------------- modules

class RMSNorm(nnx.Module):
    """x / rms(x) * weight, computed in fp32 (as HF does)."""

    def __init__(self, dim: int, eps: float, dtype, param_dtype):
        self.eps, self.dtype = eps, dtype
        self.weight = _param(None, _ones, (dim,), param_dtype, (None,))

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(self.dtype) * xf.astype(self.dtype)


class Attention(nnx.Module):
    def __init__(self, c: DecoderConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(c.initializer_range)
        D, H, K, hd, pd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.param_dtype
        self.c = c
        self.q_proj = _param(rngs, init, (D, H * hd), pd, ("fsdp", "tensor"))
        self.k_proj = _param(rngs, init, (D, K * hd), pd, ("fsdp", "tensor"))
        self.v_proj = _param(rngs, init, (D, K * hd), pd, ("fsdp", "tensor"))
        self.o_proj = _param(rngs, init, (H * hd, D), pd, ("tensor", "fsdp"))
        if c.qk_norm:
            self.q_norm = RMSNorm(hd, c.rms_eps, c.dtype, pd)
            self.k_norm = RMSNorm(hd, c.rms_eps, c.dtype, pd)

    def _proj(self, x, w, heads):
        y = jnp.einsum("bld,de->ble", x, w[...].astype(self.c.dtype))
        return y.reshape(*y.shape[:2], heads, self.c.head_dim)

    def __call__(self, x, positions, mask, inv_freq, kv=None, slots=None):
        """x [B, L, D]; mask [B, L, S]. With `kv` (cache [B, S, K, hd] pair),
        the new keys/values go to cache slots `slots` [B, L] first (index S
        drops a write) and attention runs over the whole cache."""
        c = self.c
        q = self._proj(x, self.q_proj, c.num_heads)
        k = self._proj(x, self.k_proj, c.num_kv_heads)
        v = self._proj(x, self.v_proj, c.num_kv_heads)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        if kv is not None:
            rows = jnp.arange(x.shape[0])[:, None]
            k = kv[0].at[rows, slots].set(k.astype(kv[0].dtype), mode="drop")
            v = kv[1].at[rows, slots].set(v.astype(kv[1].dtype), mode="drop")
            kv = (k, v)
        out = attention(q, k.astype(q.dtype), v.astype(q.dtype), mask)
        out = out.reshape(*out.shape[:2], -1)
        return jnp.einsum("ble,ed->bld", out, self.o_proj[...].astype(c.dtype)), kv


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate x) * up x)."""

    def __init__(self, c: DecoderConfig, rngs: nnx.Rngs):
        init = nnx.initializers.normal(c.initializer_range)
        D, F, pd = c.hidden_size, c.intermediate_size, c.param_dtype
        self.dtype = c.dtype
        self.gate_proj = _param(rngs, init, (D, F), pd, ("fsdp", "tensor"))
        self.up_proj = _param(rngs, init, (D, F), pd, ("fsdp", "tensor"))
        self.down_proj = _param(rngs, init, (F, D), pd, ("tensor", "fsdp"))

    def __call__(self, x):
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731
        g = jnp.einsum("bld,df->blf", x, w(self.gate_proj))
        u = jnp.einsum("bld,df->blf", x, w(self.up_proj))
        return jnp.einsum("blf,fd->bld", jax.nn.silu(g) * u, w(self.down_proj))


class Block(nnx.Module):
    def __init__(self, c: DecoderConfig, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps, c.dtype, c.param_dtype)
        self.self_attn = Attention(c, rngs)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps, c.dtype,
                                                c.param_dtype)
        self.mlp = MLP(c, rngs)

    def __call__(self, x, positions, mask, inv_freq, kv=None, slots=None):
        a, kv = self.self_attn(self.input_layernorm(x), positions, mask, inv_freq, kv, slots)
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x)), kv


def _block_call(block, x, positions, mask, inv_freq):
    return block(x, positions, mask, inv_freq)[0]


_remat_block_call = nnx.remat(_block_call)


@struct.dataclass
class KVCache:
    """Per-layer keys and values, each [batch, max_len, num_kv_heads, head_dim]."""

    k: tuple
    v: tuple

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.k[0].shape[1]


class Decoder(nnx.Module):
    """Embeddings, num_layers x (RMSNorm, GQA attention, RMSNorm, SwiGLU), RMSNorm, lm_head.

    With `tie_embeddings` the lm_head is the embedding matrix.
    """

    def __init__(self, config: DecoderConfig, rngs: nnx.Rngs | None = None):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        c = self.config = config
        init = nnx.initializers.normal(c.initializer_range)
        self.embed_tokens = _param(rngs, init, (c.vocab_size, c.hidden_size), c.param_dtype,
                                   ("tensor", "fsdp"))
        self.layers = nnx.List([Block(c, rngs) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_eps, c.dtype, c.param_dtype)
        if not c.tie_embeddings:
            self.lm_head = _param(rngs, init, (c.hidden_size, c.vocab_size), c.param_dtype,
                                  ("fsdp", "tensor"))

    # -- shared pieces

    def _inv_freq(self) -> jax.Array:
        return jnp.asarray(rope_inv_freq(self.config))

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, L] int -> [B, L, D] in the compute dtype."""
        return jnp.take(self.embed_tokens[...], tokens, axis=0).astype(self.config.dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final hidden states [..., D] (already normed) -> fp32 logits [..., V]."""
        dt = self.config.dtype
        if self.config.tie_embeddings:
            return jnp.einsum("...d,vd->...v", hidden, self.embed_tokens[...].astype(dt),
                              preferred_element_type=jnp.float32)
        return jnp.einsum("...d,dv->...v", hidden, self.lm_head[...].astype(dt),
                          preferred_element_type=jnp.float32)

    # -- training / scoring

    def hidden_states(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                      subtree_end: jax.Array | None = None) -> jax.Array:
        """Final normed hidden states [B, L, D] of packed rows (see `__call__`)."""
        _check_2d(tokens=tokens, positions=positions, segment_ids=segment_ids)
        mask = attention_mask(segment_ids, subtree_end)
        inv_freq = self._inv_freq()
        x = self.embed(tokens)
        call = _remat_block_call if self.config.remat else _block_call
        for block in self.layers:
            x = call(block, x, positions, mask, inv_freq)
        return self.norm(x)

    def __call__(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                 subtree_end: jax.Array | None = None) -> jax.Array:
        """Logits of packed rows.

        tokens, positions (restart at 0 per segment), segment_ids (1.. per
        row, 0 = padding), subtree_end (tree packing only): [B, L] int.
        Returns fp32 logits [B, L, V]; logits[b, p] predicts the token after p.
        """
        return self.logits(self.hidden_states(tokens, positions, segment_ids, subtree_end))

    # -- sampling with a KV cache

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty cache for `batch` rows of up to `max_len` positions each.

        dtype defaults to the compute dtype. The cache is a pytree (KVCache);
        pass it through `jax.jit` and donate it to update in place.
        """
        c = self.config
        shape = (batch, max_len, c.num_kv_heads, c.head_dim)
        dt = c.dtype if dtype is None else dtype
        zeros = tuple(jnp.zeros(shape, dt) for _ in range(c.num_layers))
        return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dt) for _ in range(c.num_layers)))

    def decode(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, *,
               logits_at: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """Runs T new tokens per row against the cache: prefill (T > 1) or a step (T = 1).

        tokens [B, T] int; positions [B, T] int: the position of each token in
        its row's sequence (0 for the first prompt token), which is also its
        cache slot. Use -1 for padding (left or right): padding writes nothing.
        Positions must be < cache.max_len (larger ones are silently dropped).
        Query (b, t) attends to slots 0..positions[b, t] of row b, which hold
        this call's tokens and everything the row wrote before. A row can be
        reused for a new request by prefilling it from position 0 again.

        Returns (logits, new_cache). logits is fp32 [B, T, V], or [B, V] when
        `logits_at` [B] int is given (the logits of token t = logits_at[b] of
        each row, e.g. the last prompt token after prefill). Shapes are static,
        so jit it once per (B, T); a step costs O(max_len) attention and O(1)
        everything else.
        """
        _check_2d(tokens=tokens, positions=positions)
        if len(cache.k) != self.config.num_layers:
            raise ValueError(f"decode: cache has {len(cache.k)} layers, model has "
                             f"{self.config.num_layers}")
        if cache.batch != tokens.shape[0]:
            raise ValueError(f"decode: cache batch {cache.batch} != tokens batch "
                             f"{tokens.shape[0]}")
        S = cache.max_len
        positions = positions.astype(jnp.int32)
        valid = positions >= 0
        slots = jnp.where(valid, positions, S)  # S is out of bounds: the write is dropped
        mask = (jnp.arange(S)[None, None, :] <= positions[:, :, None]) & valid[:, :, None]
        rope_pos = jnp.maximum(positions, 0)
        inv_freq = self._inv_freq()
        x = self.embed(tokens)
        new_k, new_v = [], []
        for i, block in enumerate(self.layers):
            x, (k, v) = block(x, rope_pos, mask, inv_freq, (cache.k[i], cache.v[i]), slots)
            new_k.append(k)
            new_v.append(v)
        x = self.norm(x)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at.astype(jnp.int32)[:, None, None], axis=1)[:, 0]
        return self.logits(x), KVCache(k=tuple(new_k), v=tuple(new_v))


def _check_2d(**arrays):
    for name, a in arrays.items():
        if a is not None and getattr(a, "ndim", None) != 2:
            raise ValueError(f"Decoder: {name} must be [batch, length], got shape "
                             f"{getattr(a, 'shape', None)}")
