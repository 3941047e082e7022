"""Accelerator attention backends: cuDNN (GPU), Pallas flash (GPU), splash (TPU).

Untested here on the devices they are for (this project's CPU machine has
none). The two Pallas wrappers are checked on CPU in Pallas interpret mode
against the dense reference (tests/models/test_attention_accel.py); the cuDNN path
has no CPU mode and is unchecked until a GPU is lent.

Masks: cuDNN takes the dense mask (as a bias) plus its causal flag, so it
fits flat rows, tree rows and decode. The Pallas kernels take segment ids
with a causal mask, so they fit flat packed rows only; padding tokens
(segment 0) get a segment of their own each so that, as in
`AttentionMask`, they see only themselves.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from ac2_jax.models.kernels.attention_mask import AttentionMask


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask) -> jax.Array:
    """`jax.nn.dot_product_attention(implementation="cudnn")`; untested here.

    q [B, Lq, H, hd], k, v [B, Lk, K, hd] in bfloat16 / float16 (cuDNN's
    flash kernel takes no fp32). The dense mask goes in as `mask` (cuDNN adds
    it as a bias); packed rows also set `is_causal`, so cuDNN skips the upper
    triangle. Queries that see no key get zeros.
    """
    half = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    if jnp.dtype(q.dtype) not in half:
        raise ValueError(
            f"cudnn attention needs bfloat16 or float16 inputs, got {q.dtype}; "
            "set DecoderConfig(dtype=jnp.bfloat16) or attention_backend='dense'"
        )
    dense = mask.dense()
    out = jax.nn.dot_product_attention(
        q,
        k.astype(q.dtype),
        v.astype(q.dtype),
        mask=dense[:, None],
        is_causal=mask.causal,
        implementation="cudnn",
    )
    return jnp.where(jnp.any(dense, -1)[:, :, None, None], out, 0).astype(q.dtype)


def _flat_rows(name: str, mask: AttentionMask) -> None:
    if mask.window is not None:
        raise ValueError(
            f"{name} attention takes no sliding window here; use 'dense', 'blocksparse' "
            "or 'cudnn' (the decoder does for a config with sliding_window)"
        )
    if mask.tree or not mask.causal:
        raise ValueError(
            f"{name} attention takes flat packed rows only (segment ids + "
            "causal); use 'dense', 'blocksparse' or 'cudnn' for tree rows and "
            "decode (choose_backend does)"
        )


def _padded_segments(segment_ids: jax.Array, length: int) -> jax.Array:
    """[B, L] -> [B, length]: padding (0) and added tokens get unique negative ids."""
    B, L = segment_ids.shape
    seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, length - L)))
    own = -(jnp.arange(length, dtype=jnp.int32) + 1)
    return jnp.where(seg > 0, seg, own[None])


def _pad_len(x: jax.Array, length: int) -> jax.Array:
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))


def _padded_flat_rows(name: str, q, k, v, mask: AttentionMask, multiple: int):
    """The inputs of a segment-id kernel (`name`, flat packed rows only: `_flat_rows`):
    q [B, L, H, hd] and k, v [B, L, K, hd] with the kv heads repeated to H and in q's
    dtype, each padded to [B, length, H, hd] (length: L rounded up to `multiple`), and
    the segment ids [B, length] (`_padded_segments`). Returns (q, k, v, segments)."""
    _flat_rows(name, mask)
    L, H = q.shape[1], q.shape[2]
    length = -(-L // multiple) * multiple
    rep = H // k.shape[2]
    kk, vv = (_pad_len(jnp.repeat(x, rep, axis=2).astype(q.dtype), length) for x in (k, v))
    return _pad_len(q, length), kk, vv, _padded_segments(mask.q_segment, length)


def pallas_gpu_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    *,
    block: int = 128,
    interpret: bool = False,
) -> jax.Array:
    """Pallas (Triton) flash attention with segment ids, flat packed rows; untested on a GPU.

    `jax.experimental.pallas.ops.gpu.attention.mha`, causal, kv heads repeated
    to the query heads; rows padded to a multiple of the blocks. `interpret`
    runs the kernel in Pallas interpret mode (any platform; slow).
    """
    from jax.experimental.pallas.ops.gpu import attention as pallas_mha

    B, L, H, hd = q.shape
    sizes = dataclasses.replace(pallas_mha.BlockSizes.get_default(), block_q=block, block_k=block)
    qq, kk, vv, seg = _padded_flat_rows("pallas_gpu", q, k, v, mask, math.lcm(block, 32))
    out = pallas_mha.mha(
        qq,
        kk,
        vv,
        seg,
        sm_scale=1.0 / math.sqrt(hd),
        causal=True,
        block_sizes=sizes,
        interpret=interpret,
    )
    return out[:, :L]


def splash_tpu_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    *,
    block: int = 128,
    interpret: bool = False,
) -> jax.Array:
    """Pallas splash attention (TPU) with segment ids, flat packed rows; untested on a TPU.

    A causal `MultiHeadMask` with `SegmentIds`, vmapped over rows; kv heads
    repeated to the query heads; q pre-scaled by 1/sqrt(hd) (splash does not
    scale); rows padded to a multiple of `block` (rounded up to 128, the TPU
    lane width). `interpret` runs it in Pallas interpret mode.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as splash_mask,
    )

    B, L, H, hd = q.shape
    b = -(-block // 128) * 128
    qq, kk, vv, seg = _padded_flat_rows("splash_tpu", q, k, v, mask, b)
    length = seg.shape[1]
    # [B, H, length, hd]; q scaled here (splash does not scale)
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (qq * (1.0 / math.sqrt(hd)), kk, vv))
    multi = splash_mask.MultiHeadMask([splash_mask.CausalMask((length, length))] * H)
    sizes = splash.BlockSizes(
        block_q=b,
        block_kv=b,
        block_kv_compute=b,
        block_q_dkv=b,
        block_kv_dkv=b,
        block_kv_dkv_compute=b,
        block_q_dq=b,
        block_kv_dq=b,
    )
    kernel = splash.make_splash_mha_single_device(multi, block_sizes=sizes, interpret=interpret)
    out = jax.vmap(kernel)(qh, kh, vh, splash.SegmentIds(q=seg, kv=seg))
    return out.transpose(0, 2, 1, 3)[:, :L].astype(q.dtype)
