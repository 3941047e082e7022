"""Attention behind one function, with the backend chosen by platform and config.

`attention(q, k, v, mask, backend=..., block=...)` takes the mask as an
`AttentionMask` (`models.kernels.attention_mask`): per-token index and segment
arrays from which both the dense [B, Lq, Lk] mask and the tiles a blocked
kernel may skip follow. A query that sees no key (decode padding) gets
zeros from every backend.

Backends: "dense" (masked softmax over [Lq, Lk] scores), "blocksparse"
(pure-JAX flash tiles that skip fully masked tiles, `models.kernels.blocksparse`),
"cudnn", "pallas_gpu", "splash_tpu" (`models.kernels.attention_accel`), "pallas_tpu"
(a Pallas TPU flash kernel under any `AttentionMask`: segment ids, the tree
mask, decode; `models.kernels.attention_tpu`). "auto" picks per platform
(`choose_backend`); the platform is the mesh's when one is set
(`jax.set_mesh`: a TPU mesh compiled ahead of time on a CPU host counts as
TPU), else JAX's default backend.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ac2_jax.models.kernels import attention_accel
from ac2_jax.models.kernels.attention_mask import NEG, AttentionMask
from ac2_jax.models.kernels.attention_tpu import pallas_tpu_attention
from ac2_jax.models.kernels.blocksparse import blocksparse_attention

# The kernels by name ("auto": by platform and shape, `choose_backend`); DecoderConfig's
# `attention_backend` takes one of them.
ATTENTION_BACKENDS = (
    "auto", "dense", "blocksparse", "cudnn", "pallas_gpu", "splash_tpu", "pallas_tpu"
)  # fmt: skip


def target_platform() -> str:
    """The platform attention compiles for: the platform of the mesh set with
    `jax.set_mesh` (also under ahead-of-time compilation for TPU devices of a
    topology on a CPU host), else `jax.default_backend()`."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def choose_backend(
    requested: str,
    *,
    kind: str,
    q_len: int,
    dtype,
    head_dim: int,
    block: int,
    platform: str | None = None,
) -> str:
    """The backend that runs: `requested`, or for "auto" the platform's pick.

    kind: "flat" / "tree" (packed rows) or "decode" (queries against a cache).
    auto: CPU -> "blocksparse" when q_len >= 4 * block, else "dense" (shorter
    rows run in milliseconds either way and the dense kernel compiles about
    2x faster); GPU ->
    "cudnn" for packed rows in bf16/fp16 with head_dim <= 128, else "dense";
    TPU -> "pallas_tpu" (flat rows, tree rows and decode alike). "pallas_gpu"
    and "splash_tpu" take flat packed rows only: tree rows and decode use
    "dense". platform: default `target_platform()`.
    """
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend must be one of {ATTENTION_BACKENDS}, got {requested!r}"
        )
    if kind not in ("flat", "tree", "decode"):
        raise ValueError(f"choose_backend: kind must be 'flat', 'tree' or 'decode', got {kind!r}")
    platform = platform or target_platform()
    if requested == "auto":
        if platform == "cpu":
            return "blocksparse" if q_len >= 4 * block else "dense"
        if platform in ("gpu", "cuda", "rocm"):
            half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            fits = kind != "decode" and half and head_dim <= 128 and head_dim % 8 == 0
            return "cudnn" if fits else "dense"
        if platform == "tpu":
            return "pallas_tpu"
        return "dense"
    if requested in ("pallas_gpu", "splash_tpu") and kind != "flat":
        return "dense"
    return requested


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask,
    *,
    backend: str = "dense",
    block: int = 128,
    kv_heads_major: bool = False,
) -> jax.Array:
    """Grouped-query attention of q [B, Lq, H, hd] over k, v [B, Lk, K, hd] (H % K == 0).

    mask: an `AttentionMask`, or a dense [B, Lq, Lk] bool array (dense backend
    only). backend: a name of `ATTENTION_BACKENDS` other than "auto" (resolve
    it with `choose_backend`). kv_heads_major: k, v are [B, K, Lk, hd] (the
    per-layer KV cache's layout); the dense backend reads them as they are,
    the others get a transposed copy. Softmax in fp32. Returns [B, Lq, H, hd]
    in q's dtype.
    """
    if backend == "dense":
        dense = mask.dense() if isinstance(mask, AttentionMask) else mask
        return dense_attention(q, k, v, dense, kv_heads_major=kv_heads_major)
    if backend == "pallas_tpu" and isinstance(mask, AttentionMask):
        return pallas_tpu_attention(
            q, k, v, mask, block_q=block, block_k=block, kv_heads_major=kv_heads_major
        )
    if kv_heads_major:
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    if not isinstance(mask, AttentionMask):
        raise ValueError(
            f"attention: backend {backend!r} needs an AttentionMask (the dense "
            "[B, Lq, Lk] array only works with backend='dense')"
        )
    if backend == "blocksparse":
        return blocksparse_attention(q, k, v, mask, block_q=block, block_k=block)
    if backend == "cudnn":
        return attention_accel.cudnn_attention(q, k, v, mask)
    if backend == "pallas_gpu":
        return attention_accel.pallas_gpu_attention(q, k, v, mask, block=block)
    if backend == "splash_tpu":
        return attention_accel.splash_tpu_attention(q, k, v, mask, block=block)
    raise ValueError(
        f"attention: backend must be one of {ATTENTION_BACKENDS[1:]} "
        f"(resolve 'auto' with choose_backend), got {backend!r}"
    )


def dense_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, kv_heads_major: bool = False
) -> jax.Array:
    """Masked softmax over all [Lq, Lk] scores. q [B, Lq, H, hd]; k, v [B, Lk, K, hd]
    ([B, K, Lk, hd] with kv_heads_major); mask [B, Lq, Lk] bool. Queries that
    see no key get zeros."""
    B, L, H, hd = q.shape
    K = k.shape[1 if kv_heads_major else 2]
    qg = q.reshape(B, L, K, H // K, hd)
    if L == 1 and jax.default_backend() == "cpu":
        out = _decode_step_attention(qg, k, v, mask, hd, "bksd" if kv_heads_major else "bskd")
    else:
        # A heads-major form of this (q pre-scaled, softmax normalised after the
        # values) was 2x faster alone but no faster inside the train step (same-
        # process A/B, docs/notes/2026-12-02-speed-work-after-the-profiles.md), so not kept.
        kv = "bksd" if kv_heads_major else "bskd"
        scores = jnp.einsum(f"blkgd,{kv}->bkgls", qg, k, preferred_element_type=jnp.float32)
        scores = jnp.where(mask[:, None, None, :, :], scores / math.sqrt(hd), NEG)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum(f"bkgls,{kv}->blkgd", probs, v)
    seen = jnp.any(mask, axis=-1)[:, :, None, None, None]
    return jnp.where(seen, out, 0).astype(q.dtype).reshape(B, L, H, hd)


def _decode_step_attention(qg, k, v, mask, hd, kv: str):
    """One query per row (sampling): two einsums over the cache as it lies (`kv`:
    "bksd" for the per-layer cache [B, K, S, hd], "bskd" for [B, S, K, hd]).
    The earlier broadcast-multiply form transposed k and v to [B, K, S, hd] at
    every step (a third of decode time,
    docs/notes/2026-12-02-where-the-step-time-goes-profiles.md); with the cache stored
    heads-major nothing is moved at all."""
    q1 = qg[:, 0]  # [B, K, G, hd]
    scores = jnp.einsum(f"bkgd,{kv}->bkgs", q1, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, 0][:, None, None, :], scores / math.sqrt(hd), NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [B, K, G, S]
    out = jnp.einsum(f"bkgs,{kv}->bkgd", probs, v)  # [B, K, G, hd]
    return out[:, None]
