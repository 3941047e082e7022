"""Relevance masks for relevance-masked self-distillation (RMSD).

RMSD keeps only the response positions that matter for the hint: first the
candidates, whose teacher-student divergence is large (top-T per group
and/or above a threshold), then of those the ones a judge selected. The
groups are what `segment_ids` says: the distillation trainer passes one id
per model response (`PairedBatch.response_ids`), so the top-T budget does not
depend on how responses were merged or packed. The loss
is token-weighted over the kept positions: pass the kept mask to
`relevance_loss` (which calls `aggregate_loss`) or to `masked_token_mean`.

Masks are float weights [..., L]; the returned masks carry the input mask's
weights on kept positions and 0 elsewhere, so they can replace a batch's
`loss_mask` directly. The jax functions are pure and jit-able; the
`selection_mask` / `ranked_positions` helpers are host numpy, for building
judge inputs and reading their answers.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ac2_jax.losses.aggregation import aggregate_loss


def _rank_within_group(divergence, mask, segment_ids):
    """Rank (0 = largest divergence) of each position within its row/segment.

    divergence, mask, segment_ids: [..., L]. Masked-out positions rank last;
    ties go to the lower position. Returns int [..., L].
    """
    div = jnp.where(mask > 0, divergence.astype(jnp.float32), -jnp.inf)
    seg = jnp.zeros(div.shape, jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    order = jnp.lexsort((-div, seg), axis=-1)  # primary: segment, then divergence descending
    sorted_seg = jnp.take_along_axis(seg, order, axis=-1)
    idx = jnp.broadcast_to(jnp.arange(div.shape[-1], dtype=jnp.int32), div.shape)
    first = jnp.ones(div.shape[:-1] + (1,), bool)
    is_start = jnp.concatenate([first, sorted_seg[..., 1:] != sorted_seg[..., :-1]], axis=-1)
    start = jax.lax.cummax(jnp.where(is_start, idx, 0), axis=div.ndim - 1)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(idx - start, inverse, axis=-1)


def candidate_mask(
    divergence: jax.Array,
    mask: jax.Array,
    top_t: int | None = None,
    threshold: float | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Candidate positions: large teacher-student divergence among mask > 0.

    divergence, mask: [..., L]. `top_t` keeps the T largest-divergence positions
    of each row, or of each group of a row when `segment_ids` [..., L] is given
    (ids of any grouping: packed segments, or model responses); `threshold`
    keeps positions with divergence >= threshold; with both, a position must
    pass both; with neither, every mask > 0 position is a candidate. Returns
    float32 [..., L]: mask's weight where kept, else 0.
    """
    if divergence.shape != mask.shape:
        raise ValueError(
            f"candidate_mask: divergence {divergence.shape} and mask {mask.shape} "
            "must have the same [..., L] shape"
        )
    if segment_ids is not None and segment_ids.shape != mask.shape:
        raise ValueError(
            f"candidate_mask: segment_ids {segment_ids.shape} must match mask {mask.shape}"
        )
    keep = mask > 0
    if top_t is not None:
        if not isinstance(top_t, numbers.Integral) or top_t < 1:
            raise ValueError(f"candidate_mask: top_t must be a positive int or None, got {top_t!r}")
        keep = keep & (_rank_within_group(divergence, mask, segment_ids) < top_t)
    if threshold is not None:
        keep = keep & (divergence >= threshold)
    return jnp.where(keep, mask.astype(jnp.float32), 0.0)


def relevance_mask(
    divergence: jax.Array,
    mask: jax.Array,
    judge_mask: jax.Array,
    top_t: int | None = None,
    threshold: float | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Kept positions = candidates (see `candidate_mask`) ∩ judge selections.

    divergence, mask, judge_mask: [..., L] (judge_mask > 0 marks a selection).
    Returns float32 [..., L]: mask's weight where kept, else 0.
    """
    if judge_mask.shape != mask.shape:
        raise ValueError(
            f"relevance_mask: judge_mask {judge_mask.shape} must match mask {mask.shape}"
        )
    return judged(candidate_mask(divergence, mask, top_t, threshold, segment_ids), judge_mask)


def judged(candidates: jax.Array, judge_mask: jax.Array) -> jax.Array:
    """`relevance_mask` from candidates already taken (`candidate_mask`'s float32
    [..., L]): candidates where judge_mask > 0 selects, else 0."""
    if judge_mask.shape != candidates.shape:
        raise ValueError(
            f"relevance_mask: judge_mask {judge_mask.shape} must match the candidates "
            f"{candidates.shape}"
        )
    return jnp.where(judge_mask > 0, candidates, 0.0)


def masked_token_mean(
    per_token: jax.Array, mask: jax.Array, axis_name: str | None = None
) -> jax.Array:
    """sum(m * l) / sum(m) over all positions (0 when nothing is kept).

    per_token, mask: [..., L]. Under pmap pass `axis_name` to sum across devices.
    Returns a scalar.
    """
    m = mask.astype(jnp.float32)
    total = jnp.sum(jnp.where(m > 0, per_token.astype(jnp.float32) * m, 0.0))
    count = m.sum()
    if axis_name is not None:
        total = jax.lax.psum(total, axis_name)
        count = jax.lax.psum(count, axis_name)
    return jnp.where(count > 0, total / jnp.where(count > 0, count, 1.0), 0.0)


def relevance_loss(
    per_token: jax.Array, batch, kept_mask: jax.Array, mode: str = "task_mean", **kwargs
) -> jax.Array:
    """RMSD batch loss: `aggregate_loss` of a PackedBatch with loss_mask := kept_mask.

    per_token, kept_mask: [R, L]. Token-weighted over kept positions per task
    (task_mean, default); tasks with nothing kept drop out of the mean.
    """
    return aggregate_loss(per_token, batch.replace(loss_mask=kept_mask), mode, **kwargs)


def selection_mask(
    selections: Sequence[Iterable[int]], length: int, offsets: int | Sequence[int] = 0
) -> np.ndarray:
    """Judge selections (positions per row) -> float32 [rows, length] mask.

    Row r gets 1 at `offsets[r] + p` for each p in selections[r] (offsets map
    response positions to columns of a packed row). Out-of-range -> ValueError.
    """
    rows = len(selections)
    offs = (
        [int(offsets)] * rows
        if isinstance(offsets, numbers.Integral)
        else [int(o) for o in offsets]  # type: ignore[union-attr]  # Integral checked above
    )
    if len(offs) != rows:
        raise ValueError(f"selection_mask: {len(offs)} offsets for {rows} rows")
    out = np.zeros((rows, length), np.float32)
    for r, (positions, off) in enumerate(zip(selections, offs, strict=True)):
        for p in positions:
            col = off + int(p)
            if not 0 <= col < length:
                raise ValueError(
                    f"selection_mask: row {r} position {p} (+offset {off}) is outside [0, {length})"
                )
            out[r, col] = 1.0
    return out


def ranked_positions(cand_mask_row, divergence_row) -> list[int]:
    """Candidate positions of one row, largest divergence first (host numpy).

    cand_mask_row, divergence_row: [L]. Ties: lower position first.
    """
    m = np.asarray(cand_mask_row)
    d = np.asarray(divergence_row, np.float64)
    if m.shape != d.shape or m.ndim != 1:
        raise ValueError(f"ranked_positions: need two [L] arrays, got {m.shape} and {d.shape}")
    pos = np.nonzero(m > 0)[0]
    return [int(p) for p in pos[np.argsort(-d[pos], kind="stable")]]
