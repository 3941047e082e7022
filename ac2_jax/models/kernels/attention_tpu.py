"""The TPU attention kernel "pallas_tpu": Pallas flash attention under any `AttentionMask`.

Backend name `"pallas_tpu"` (`models.kernels.attention.ATTENTION_BACKENDS`; "auto"
picks it on TPU for packed rows, flat or tree, and for decode). Unlike splash
attention (`attention_accel.splash_tpu_attention`), whose masks are static
numpy patterns, this kernel reads the mask's per-token arrays at run time, so
it honours the packed layout (segment ids, padding) AND the shared-prefix
tree mask (`subtree_end`: query i sees key j iff j <= i <= subtree_end[j])
and the KV-cache mask of decode, by the one predicate `attention_mask.visible`.

Layout. Grouped-query heads are folded into query rows: q [B, Lq, H, hd]
becomes [B, K, G * Lq, hd] (G = H / K query heads per kv head; rows padded
to the q block), so each k/v block is read once per kv head and the dk / dv
of a group need no reduction. Per query row the kernel reads q_index /
q_segment as [rows, 1] columns, per key kv_index / kv_segment / kv_end as
[1, Lk] rows, and the log-sum-exp goes out as a [rows, 1] column (splash
broadcasts them over 128 lanes / 8 sublanes; XLA's TPU layout pads a minor
dimension of 1 to the 128 lanes anyway, so the HBM is the same: a q-side
array costs rows x 512 bytes). The tile table
`AttentionMask.tiles` (a superset of the tiles holding a visible pair) is
scalar-prefetched: a fully masked tile is neither computed nor fetched (its
k / v block index repeats the last visible one, so the pipeline issues no
copy).

Kernels (FlashAttention-2): forward, grid (B, K, q blocks, k blocks), online
softmax in fp32 (running max / sum in VMEM scratch), saves the log-sum-exp;
backward, two kernels recomputing each visible tile from it: dq (grid as the
forward) and dk / dv (grid (B, K, k blocks, q blocks)). Matmuls take the
inputs' dtype with fp32 accumulation; p is cast to v's dtype for p @ v (as
every flash kernel does). A query that sees no key gets zeros.

Blocks: block_q rows and block_k keys, rounded up on TPU to multiples of 8
and of 128 (the lane width: a `DecoderConfig.attention_block` of 64 runs
128-key tiles); interpret mode (`interpret=True`, any platform)
takes any sizes, which the CPU tests use to stay small. Not supported (refused
by name): a sliding window (the decoder runs "dense" for one).

Sharding: under a mesh (`jax.set_mesh`) the kernel runs in `jax.shard_map`
with rows over the rules' "batch" axes and kv heads over their "kv" axes
(`models.axes.active_rules`), so it does not gather a sharded batch. A batch
(kv heads) that those axes do not divide runs replicated over them: gathered,
still exact.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from ac2_jax.models.kernels.attention_mask import NEG, AttentionMask, check_shapes, visible

__all__ = ["flat_rule", "fold_rows", "pallas_tpu_attention"]

LANES, SUBLANES = 128, 8


class _Flags(NamedTuple):
    """The static part of a mask that `visible` reads."""

    tree: bool
    window: None = None


_FLAT = _Flags(tree=False)


def pallas_tpu_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: AttentionMask,
    *,
    block_q: int = 128,
    block_k: int = 128,
    kv_heads_major: bool = False,
    interpret: bool = False,
) -> jax.Array:
    """Grouped-query attention of q [B, Lq, H, hd] over k, v [B, Lk, K, hd]
    ([B, K, Lk, hd] with kv_heads_major, the KV cache's layout) under `mask`
    (shape (B, Lq, Lk); flat or tree packed rows, or decode). Lengths need not
    be multiples of the blocks (padded inside). Returns [B, Lq, H, hd] in q's
    dtype; differentiable in q, k, v."""
    if mask.window is not None:
        raise ValueError(
            "pallas_tpu attention takes no sliding window; use 'dense' or 'blocksparse' "
            "(the decoder does for a config with sliding_window)"
        )
    if not kv_heads_major:
        k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    B, Lq, H, hd = q.shape
    K, Lk = k.shape[1], k.shape[2]
    check_shapes("pallas_tpu attention", q.shape, Lk, K, mask)
    mesh = jax.sharding.get_abstract_mesh()
    run = functools.partial(
        _attend, block_q=block_q, block_k=block_k, tree=mask.tree, interpret=interpret
    )
    arrays = (mask.q_index, mask.q_segment, mask.kv_index, mask.kv_segment, mask.kv_end)
    if mesh.empty:
        return run(q, k, v, *arrays)
    from ac2_jax.models.axes import active_rules

    rules = active_rules()
    rows = rules.spec(("batch",), mesh)[0]
    heads = rules.spec(("kv",), mesh)[0]
    ways = lambda axes: math.prod(  # noqa: E731
        mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ())
    )
    rows = rows if B % ways(rows) == 0 else None
    heads = heads if K % ways(heads) == 0 else None
    spec_q, spec_kv, spec_ids = P(rows, None, heads, None), P(rows, heads, None, None), P(rows)
    return jax.shard_map(
        run,
        mesh=mesh,
        in_specs=(spec_q, spec_kv, spec_kv) + (spec_ids,) * 5,
        out_specs=spec_q,
        check_vma=False,
    )(q, k, v, *arrays)


def _attend(q, k, v, q_index, q_segment, kv_index, kv_segment, kv_end, *, block_q, block_k,
            tree, interpret):  # fmt: skip
    """Local shapes: q [B, Lq, H, hd], k / v [B, K, Lk, hd], the mask's arrays."""
    B, Lq, H, hd = q.shape
    K, Lk = k.shape[1], k.shape[2]
    G = H // K
    mask = flat_rule(AttentionMask(q_index, kv_index, q_segment, kv_segment, kv_end, tree=tree))
    up = lambda n, m: -(-n // m) * m  # noqa: E731  (n rounded up to a multiple of m)
    rows = G * Lq
    if interpret:
        bk, bq = min(block_k, Lk), min(block_q, rows)
    else:  # Mosaic's block rule: keys a multiple of the lanes, rows of the sublanes
        bk = min(up(block_k, LANES), up(Lk, LANES))
        bq = min(up(block_q, SUBLANES), up(rows, SUBLANES))
    Lk_p = up(Lk, bk)
    Lq_p = Lq
    mask = mask.pad(Lq_p, Lk_p)
    rows_p = -(-(G * Lq_p) // bq) * bq
    # rows: (g, query) of each kv head; the mask's q arrays repeat per g
    qr = jnp.pad(q, ((0, 0), (0, Lq_p - Lq), (0, 0), (0, 0))).reshape(B, Lq_p, K, G, hd)
    qr = qr.transpose(0, 2, 3, 1, 4).reshape(B, K, G * Lq_p, hd)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, rows_p - G * Lq_p), (0, 0)))
    folded = fold_rows(mask, G, rows_p)
    kp, vp = (jnp.pad(x, ((0, 0), (0, 0), (0, Lk_p - Lk), (0, 0))) for x in (k, v))
    out = _flash(bq, bk, interpret, qr, kp, vp, *_mask_arrays(folded, bq, bk))
    out = out[:, :, : G * Lq_p].reshape(B, K, G, Lq_p, hd).transpose(0, 3, 1, 2, 4)
    return out.reshape(B, Lq_p, H, hd)[:, :Lq].astype(q.dtype)


def fold_rows(mask: AttentionMask, G: int, rows: int) -> AttentionMask:
    """The mask of one kv head's query rows as the kernel lays them out, (g, query)
    for g < G (the q arrays repeated per g), padded to `rows` rows that see nothing
    (q_index -1, segment 0). Its `tiles(block_q, block_k)` is the kernel's tile table."""
    Lq = mask.shape[1]
    fill = lambda x, value: jnp.pad(  # noqa: E731
        jnp.tile(x, (1, G)), ((0, 0), (0, rows - G * Lq)), constant_values=value
    )
    return AttentionMask(
        fill(mask.q_index, -1), mask.kv_index, fill(mask.q_segment, 0), mask.kv_segment,
        mask.kv_end,
    )  # fmt: skip


def flat_rule(mask: AttentionMask) -> AttentionMask:
    """The same mask under the flat rule (segments equal and real): a tree mask's rule
    (both segments real) is the flat rule on 0 / 1 segments, so flat rows, tree rows
    and decode run one kernel (one compilation for all)."""
    if not mask.tree:
        return mask
    real = lambda s: (s > 0).astype(jnp.int32)  # noqa: E731
    return dataclasses.replace(
        mask, q_segment=real(mask.q_segment), kv_segment=real(mask.kv_segment), tree=False
    )


def _mask_arrays(mask: AttentionMask, bq: int, bk: int):
    """(tiles [B*nq*nk], k block map [B*nq*nk], q block map [B*nk*nq], q ids
    (q_index, q_segment) [B, rows, 1] each, kv ids (kv_index, kv_segment,
    kv_end) [B, 1, Lk] each)."""
    vis = mask.tiles(bq, bk).astype(jnp.int32)  # [B, nq, nk]
    B, nq, nk = vis.shape
    # a masked tile fetches the block of the last visible one before it (no copy)
    kmap = jax.lax.cummax(jnp.where(vis > 0, jnp.arange(nk, dtype=jnp.int32), 0), axis=2)
    vis_t = vis.transpose(0, 2, 1)
    qmap = jax.lax.cummax(jnp.where(vis_t > 0, jnp.arange(nq, dtype=jnp.int32), 0), axis=2)
    col = lambda x: x[:, :, None]  # noqa: E731
    row = lambda x: x[:, None]  # noqa: E731
    return (
        vis.reshape(-1), kmap.reshape(-1), qmap.reshape(-1),
        col(mask.q_index), col(mask.q_segment),
        row(mask.kv_index), row(mask.kv_segment), row(mask.kv_end),
    )  # fmt: skip


# ----------------------------------------------------------------------------- kernels


def _allowed(qi_ref, qs_ref, ki_ref, ks_ref, ke_ref):
    """[bq, bk] bool of a tile (the flat rule), from its q ids [bq, 1] and kv ids [1, bk]."""
    qi, qs = qi_ref[:, 0:1], qs_ref[:, 0:1]  # [bq, 1]
    ki, ks, ke = ki_ref[0:1, :], ks_ref[0:1, :], ke_ref[0:1, :]  # [1, bk]
    return visible(_FLAT, qi, ki, qs, ks, ke, None, None)


def _nt(a, b):  # a [m, d] . b [n, d]^T -> [m, n] fp32
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _tn(a, b):  # a [m, n]^T . b [m, d] -> [n, d] fp32
    return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _nn(a, b):  # a [m, n] . b [n, d] -> [m, d] fp32
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _fwd_kernel(tiles, kmap, qmap, q_ref, k_ref, v_ref, *refs, scale, nq, nk):
    """refs: the 5 id blocks, then o, lse; scratch m, l, acc."""
    from jax.experimental import pallas as pl  # lazy: it probes for libtpu

    del kmap, qmap
    ids, (o_ref, lse_ref, m_sc, l_sc, acc_sc) = refs[:5], refs[5:]
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, NEG, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(tiles[(b * nq + i) * nk + j] != 0)
    def _tile():
        allowed = _allowed(*ids)
        s = jnp.where(allowed, _nt(q_ref[...], k_ref[...]) * scale, NEG)  # [bq, bk]
        m_old = m_sc[:, 0:1]
        m_new = jnp.maximum(m_old, jnp.max(s, axis=1, keepdims=True))
        p = jnp.where(allowed, jnp.exp(s - m_new), 0.0)
        alpha = jnp.exp(m_old - m_new)
        l_new = alpha * l_sc[:, 0:1] + jnp.sum(p, axis=1, keepdims=True)
        acc_sc[...] = acc_sc[...] * alpha + _nn(p.astype(v_ref.dtype), v_ref[...])
        m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
        l_sc[...] = jnp.broadcast_to(l_new, l_sc.shape)

    @pl.when(j == nk - 1)
    def _finish():
        lsum = l_sc[:, 0:1]
        seen = lsum > 0
        safe = jnp.where(seen, lsum, 1.0)
        o_ref[...] = jnp.where(seen, acc_sc[...] / safe, 0.0).astype(o_ref.dtype)
        lse = jnp.where(seen, m_sc[:, 0:1] + jnp.log(safe), 0.0)
        lse_ref[...] = lse


def _dq_kernel(tiles, kmap, qmap, q_ref, k_ref, v_ref, *refs, scale, nq, nk):
    """refs: the 5 id blocks, do, lse, delta, then dq; scratch dq."""
    from jax.experimental import pallas as pl  # lazy: it probes for libtpu

    del kmap, qmap
    ids, (do_ref, lse_ref, delta_ref, dq_ref, dq_sc) = refs[:5], refs[5:]
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(tiles[(b * nq + i) * nk + j] != 0)
    def _tile():
        allowed = _allowed(*ids)
        s = _nt(q_ref[...], k_ref[...]) * scale
        p = jnp.where(allowed, jnp.exp(s - lse_ref[:, 0:1]), 0.0)
        dp = _nt(do_ref[...], v_ref[...])
        ds = p * (dp - delta_ref[:, 0:1]) * scale
        dq_sc[...] += _nn(ds.astype(k_ref.dtype), k_ref[...])

    @pl.when(j == nk - 1)
    def _finish():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def _dkv_kernel(tiles, kmap, qmap, q_ref, k_ref, v_ref, *refs, scale, nq, nk):
    """refs: the 5 id blocks, do, lse, delta, then dk, dv; scratch dk, dv."""
    from jax.experimental import pallas as pl  # lazy: it probes for libtpu

    del kmap, qmap
    ids, (do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_sc, dv_sc) = refs[:5], refs[5:]
    b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(i == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(tiles[(b * nq + i) * nk + j] != 0)
    def _tile():
        allowed = _allowed(*ids)
        q, do = q_ref[...], do_ref[...]
        s = _nt(q, k_ref[...]) * scale
        p = jnp.where(allowed, jnp.exp(s - lse_ref[:, 0:1]), 0.0)  # [bq, bk]
        dv_sc[...] += _tn(p.astype(do.dtype), do)
        dp = _nt(do, v_ref[...])
        ds = p * (dp - delta_ref[:, 0:1]) * scale
        dk_sc[...] += _tn(ds.astype(q.dtype), q)

    @pl.when(i == nq - 1)
    def _finish():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


# ----------------------------------------------------------------------------- calls


def _specs(bq, bk, hd, nq, nk, kv_major: bool):
    """BlockSpecs of q-side rows, k-side rows and the ids, for a grid whose last two
    axes are (q block, k block), or (k block, q block) when kv_major."""
    from jax.experimental import pallas as pl  # lazy: it probes for libtpu

    def ij(i1, i2, qmap, kmap, b):  # (q block, k block) of a grid step, fetch-redirected
        if kv_major:
            return qmap[(b * nk + i1) * nq + i2], i1
        return i1, kmap[(b * nq + i1) * nk + i2]

    def q_rows(b, h, i1, i2, tiles, kmap, qmap):
        return (b, h, ij(i1, i2, qmap, kmap, b)[0], 0)

    def k_rows(b, h, i1, i2, tiles, kmap, qmap):
        return (b, h, ij(i1, i2, qmap, kmap, b)[1], 0)

    def q_ids(b, h, i1, i2, tiles, kmap, qmap):
        return (b, ij(i1, i2, qmap, kmap, b)[0], 0)

    def kv_ids(b, h, i1, i2, tiles, kmap, qmap):
        return (b, 0, ij(i1, i2, qmap, kmap, b)[1])

    def q_col(b, h, i1, i2, tiles, kmap, qmap):
        return (b, h, ij(i1, i2, qmap, kmap, b)[0], 0)

    return dict(
        q=pl.BlockSpec((None, None, bq, hd), q_rows),
        k=pl.BlockSpec((None, None, bk, hd), k_rows),
        ids=[pl.BlockSpec((None, bq, 1), q_ids)] * 2 + [pl.BlockSpec((None, 1, bk), kv_ids)] * 3,
        col=pl.BlockSpec((None, None, bq, 1), q_col),
    )


def _cost(q, k, matmuls: int):
    """XLA's cost estimate of a kernel doing `matmuls` [rows, Lk] x hd matmuls per kv
    head: an upper bound (every tile; the kernel skips the fully masked ones)."""
    from jax.experimental import pallas as pl  # lazy: it probes for libtpu

    B, K, R, hd = q.shape
    pairs = B * K * R * k.shape[2]
    size = lambda x: x.size * x.dtype.itemsize  # noqa: E731
    return pl.CostEstimate(
        flops=int(2 * matmuls * pairs * hd),
        transcendentals=int(pairs),
        bytes_accessed=int(2 * size(q) + 2 * size(k)),
    )


def _params():
    from jax.experimental.pallas import tpu as pltpu

    sem = ("parallel", "parallel", "parallel", "arbitrary")
    return pltpu.CompilerParams(dimension_semantics=sem)


def _forward(bq, bk, interpret, q, k, v, tiles, kmap, qmap, *ids):
    from jax.experimental import pallas as pl  # lazy: it probes for libtpu
    from jax.experimental.pallas import tpu as pltpu

    B, K, R, hd = q.shape
    nq, nk = R // bq, k.shape[2] // bk
    sp = _specs(bq, bk, hd, nq, nk, kv_major=False)
    kernel = functools.partial(_fwd_kernel, scale=1.0 / math.sqrt(hd), nq=nq, nk=nk)
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, K, nq, nk),
            in_specs=[sp["q"], sp["k"], sp["k"], *sp["ids"]],
            out_specs=[sp["q"], sp["col"]],
            scratch_shapes=[
                pltpu.VMEM((bq, LANES), jnp.float32),
                pltpu.VMEM((bq, LANES), jnp.float32),
                pltpu.VMEM((bq, hd), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((B, K, R, 1), jnp.float32),
        ],
        compiler_params=_params(),
        interpret=interpret,
        cost_estimate=_cost(q, k, 2),  # s, p v
        name="ac2_pallas_tpu_attention_fwd",
    )(tiles, kmap, qmap, q, k, v, *ids)
    return out, lse[..., 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _flash(bq, bk, interpret, q, k, v, tiles, kmap, qmap, *ids):
    return _forward(bq, bk, interpret, q, k, v, tiles, kmap, qmap, *ids)[0]


def _flash_fwd(bq, bk, interpret, q, k, v, tiles, kmap, qmap, *ids):
    out, lse = _forward(bq, bk, interpret, q, k, v, tiles, kmap, qmap, *ids)
    return out, (q, k, v, tiles, kmap, qmap, *ids, out, lse)


def _flash_bwd(bq, bk, interpret, res, dout):
    from jax.experimental import pallas as pl  # lazy: it probes for libtpu
    from jax.experimental.pallas import tpu as pltpu

    q, k, v, tiles, kmap, qmap, *ids, out, lse = res
    B, K, R, hd = q.shape
    Lk = k.shape[2]
    nq, nk = R // bq, Lk // bk
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    col = lambda x: x[..., None]  # noqa: E731
    scale = 1.0 / math.sqrt(hd)
    args = (tiles, kmap, qmap, q, k, v, *ids, dout, col(lse), col(delta))

    sp = _specs(bq, bk, hd, nq, nk, kv_major=False)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, nq=nq, nk=nk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, K, nq, nk),
            in_specs=[sp["q"], sp["k"], sp["k"], *sp["ids"], sp["q"], sp["col"], sp["col"]],
            out_specs=sp["q"],
            scratch_shapes=[pltpu.VMEM((bq, hd), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(),
        interpret=interpret,
        cost_estimate=_cost(q, k, 3),  # s, dp, dq
        name="ac2_pallas_tpu_attention_dq",
    )(*args)

    sp = _specs(bq, bk, hd, nq, nk, kv_major=True)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, nq=nq, nk=nk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, K, nk, nq),
            in_specs=[sp["q"], sp["k"], sp["k"], *sp["ids"], sp["q"], sp["col"], sp["col"]],
            out_specs=[sp["k"], sp["k"]],
            scratch_shapes=[pltpu.VMEM((bk, hd), jnp.float32)] * 2,
        ),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(),
        interpret=interpret,
        cost_estimate=_cost(q, k, 4),  # s, dv, dp, dk
        name="ac2_pallas_tpu_attention_dkv",
    )(*args)
    return (dq, dk, dv) + (None,) * (3 + len(ids))


_flash.defvjp(_flash_fwd, _flash_bwd)
