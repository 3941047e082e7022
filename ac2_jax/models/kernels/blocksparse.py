"""Block-sparse flash attention in pure JAX (the CPU kernel; runs anywhere).

Attention is computed in (q_block, k_block) tiles with an online softmax
(running max, sum and weighted values per query), so no [Lq, Lk] score
matrix is ever held. Only the tiles that `AttentionMask.tiles` marks as
possibly visible are computed: their list is built per call and a
`lax.while_loop` runs exactly that many iterations, so packed rows of short
segments and tree rows cost a fraction of the dense [Lq, Lk] work. The
backward pass (`jax.custom_vjp`) recomputes each visible tile from the saved
log-sum-exp (FlashAttention-2), again skipping the masked ones. All tile math
is fp32; results are cast to q's dtype.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ac2_jax.models.kernels.attention_mask import NEG, AttentionMask, check_shapes, visible


def blocksparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    *,
    block_q: int = 128,
    block_k: int = 128,
) -> jax.Array:
    """Grouped-query attention, fully masked tiles skipped.

    q [B, Lq, H, hd]; k, v [B, Lk, K, hd] (H % K == 0); mask of shape (B, Lq, Lk).
    Lengths need not be multiples of the blocks (padded inside; block_q is
    capped at Lq, so a decode step uses one-query tiles). Returns [B, Lq, H, hd].
    """
    return blocksparse_attention_with_count(q, k, v, mask, block_q=block_q, block_k=block_k)[0]


def blocksparse_attention_with_count(
    q, k, v, mask: AttentionMask, *, block_q: int = 128, block_k: int = 128
) -> tuple[jax.Array, jax.Array]:
    """`blocksparse_attention` and the number of tiles its forward loop computed
    (int32 scalar, summed over rows; the dense count is B * ceil(Lq/bq) * ceil(Lk/bk))."""
    B, Lq, H, hd = q.shape
    Lk, K = k.shape[1], k.shape[2]
    check_shapes("blocksparse_attention", q.shape, Lk, K, mask)
    bq, bk = min(block_q, Lq), min(block_k, Lk)
    pq, pk = -Lq % bq, -Lk % bk
    mask = mask.pad(Lq + pq, Lk + pk)
    qp = jnp.pad(q, ((0, 0), (0, pq), (0, 0), (0, 0)))
    kp = jnp.pad(k, ((0, 0), (0, pk), (0, 0), (0, 0)))
    vp = jnp.pad(v, ((0, 0), (0, pk), (0, 0), (0, 0)))
    out, count = _flash(bq, bk, qp, kp, vp, mask)
    return out[:, :Lq], count


def _tile_list(mask: AttentionMask, bq: int, bk: int):
    """(tiles [n] flat (b, qb, kb) indices, visible first; number visible)."""
    vis = mask.tiles(bq, bk).reshape(-1)
    order = jnp.nonzero(vis, size=vis.shape[0], fill_value=0)[0].astype(jnp.int32)
    return order, jnp.sum(vis, dtype=jnp.int32)


def _q_layout(x, K):
    """[B, Lq, H, hd] -> [B, K, G, Lq, hd] fp32 (tile slices along Lq)."""
    B, Lq, H, hd = x.shape
    return x.reshape(B, Lq, K, H // K, hd).transpose(0, 2, 3, 1, 4).astype(jnp.float32)


def _k_layout(x):
    """[B, Lk, K, hd] -> [B, K, Lk, hd] fp32."""
    return x.transpose(0, 2, 1, 3).astype(jnp.float32)


def _q_unlayout(x, dtype):
    """[B, K, G, Lq, hd] -> [B, Lq, H, hd]."""
    B, K, G, Lq, hd = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(B, Lq, K * G, hd).astype(dtype)


class _Tile:
    """Where tile number `t` of the list sits, and its slices."""

    def __init__(self, t, nq, nk, bq, bk, mask: AttentionMask):
        self.b, self.qa, self.ka = t // (nq * nk), (t // nk) % nq * bq, t % nk * bk
        self.bq, self.bk = bq, bk
        row = lambda x, a, n: jax.lax.dynamic_slice(x, (self.b, a), (1, n))[0]  # noqa: E731
        qi, qs = row(mask.q_index, self.qa, bq), row(mask.q_segment, self.qa, bq)
        ki, ks = row(mask.kv_index, self.ka, bk), row(mask.kv_segment, self.ka, bk)
        ke = row(mask.kv_end, self.ka, bk)
        qp, kp = row(mask.query_pos, self.qa, bq), row(mask.key_pos, self.ka, bk)
        self.allowed = visible(  # [bq, bk]
            mask, qi[:, None], ki[None], qs[:, None], ks[None], ke[None], qp[:, None], kp[None]
        )

    def q(self, x):  # [B, K, G, Lq, ...] -> [K, G, bq, ...]
        start = (self.b, 0, 0, self.qa) + (0,) * (x.ndim - 4)
        return jax.lax.dynamic_slice(x, start, (1, *x.shape[1:3], self.bq, *x.shape[4:]))[0]

    def k(self, x):  # [B, K, Lk, hd] -> [K, bk, hd]
        return jax.lax.dynamic_slice(
            x, (self.b, 0, self.ka, 0), (1, x.shape[1], self.bk, x.shape[3])
        )[0]

    def set_q(self, x, t):
        start = (self.b, 0, 0, self.qa) + (0,) * (x.ndim - 4)
        return jax.lax.dynamic_update_slice(x, t[None].astype(x.dtype), start)

    def add_q(self, x, t):
        return self.set_q(x, self.q(x) + t)

    def add_k(self, x, t):
        return jax.lax.dynamic_update_slice(x, (self.k(x) + t)[None], (self.b, 0, self.ka, 0))


def _forward(bq, bk, q, k, v, mask):
    B, Lq, H, hd = q.shape
    K, Lk = k.shape[2], k.shape[1]
    nq, nk = Lq // bq, Lk // bk
    qt, kt, vt = _q_layout(q, K), _k_layout(k), _k_layout(v)
    order, count = _tile_list(mask, bq, bk)
    scale = 1.0 / math.sqrt(hd)

    def body(carry):
        i, acc, m, lsum = carry
        tile = _Tile(order[i], nq, nk, bq, bk, mask)
        s = jnp.einsum("kgqd,ksd->kgqs", tile.q(qt), tile.k(kt)) * scale
        s = jnp.where(tile.allowed, s, -jnp.inf)
        m_old, l_old = tile.q(m), tile.q(lsum)
        m_new = jnp.maximum(m_old, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        alpha = jnp.exp(m_old - m_new)
        pv = jnp.einsum("kgqs,ksd->kgqd", p, tile.k(vt))
        acc = tile.set_q(acc, tile.q(acc) * alpha[..., None] + pv)
        m = tile.set_q(m, m_new)
        lsum = tile.set_q(lsum, l_old * alpha + p.sum(-1))
        return i + 1, acc, m, lsum

    init = (
        jnp.int32(0),
        jnp.zeros(qt.shape, jnp.float32),
        jnp.full(qt.shape[:-1], NEG, jnp.float32),
        jnp.zeros(qt.shape[:-1], jnp.float32),
    )
    _, acc, m, lsum = jax.lax.while_loop(lambda c: c[0] < count, body, init)
    seen = lsum > 0
    l_safe = jnp.where(seen, lsum, 1.0)
    out = jnp.where(seen[..., None], acc / l_safe[..., None], 0.0)  # [B, K, G, Lq, hd]
    lse = jnp.where(seen, m + jnp.log(l_safe), 0.0)  # [B, K, G, Lq]
    return _q_unlayout(out, q.dtype), lse, count


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash(bq, bk, q, k, v, mask):
    out, _, count = _forward(bq, bk, q, k, v, mask)
    return out, count


def _flash_fwd(bq, bk, q, k, v, mask):
    out, lse, count = _forward(bq, bk, q, k, v, mask)
    return (out, count), (q, k, v, mask, out, lse)


def _flash_bwd(bq, bk, res, cotangents):
    q, k, v, mask, out, lse = res
    dout = cotangents[0]
    B, Lq, H, hd = q.shape
    K, Lk = k.shape[2], k.shape[1]
    nq, nk = Lq // bq, Lk // bk
    qt, kt, vt, dot = _q_layout(q, K), _k_layout(k), _k_layout(v), _q_layout(dout, K)
    delta = jnp.sum(dot * _q_layout(out, K), axis=-1)  # [B, K, G, Lq]
    order, count = _tile_list(mask, bq, bk)
    scale = 1.0 / math.sqrt(hd)

    def body(carry):
        i, dq, dk, dv = carry
        tile = _Tile(order[i], nq, nk, bq, bk, mask)
        q_t, k_t, v_t, do_t = tile.q(qt), tile.k(kt), tile.k(vt), tile.q(dot)
        s = jnp.einsum("kgqd,ksd->kgqs", q_t, k_t) * scale
        p = jnp.where(tile.allowed, jnp.exp(s - tile.q(lse)[..., None]), 0.0)
        dv = tile.add_k(dv, jnp.einsum("kgqs,kgqd->ksd", p, do_t))
        dp = jnp.einsum("kgqd,ksd->kgqs", do_t, v_t)
        ds = p * (dp - tile.q(delta)[..., None]) * scale
        dq = tile.add_q(dq, jnp.einsum("kgqs,ksd->kgqd", ds, k_t))
        dk = tile.add_k(dk, jnp.einsum("kgqs,kgqd->ksd", ds, q_t))
        return i + 1, dq, dk, dv

    init = (
        jnp.int32(0),
        jnp.zeros(qt.shape, jnp.float32),
        jnp.zeros(kt.shape, jnp.float32),
        jnp.zeros(vt.shape, jnp.float32),
    )
    _, dq, dk, dv = jax.lax.while_loop(lambda c: c[0] < count, body, init)
    dk = dk.transpose(0, 2, 1, 3).astype(k.dtype)
    dv = dv.transpose(0, 2, 1, 3).astype(v.dtype)
    return _q_unlayout(dq, q.dtype), dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)
