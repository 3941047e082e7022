"""Packing segments into fixed-shape rows (first-fit decreasing).

The rows are a `batch.PackedBatch` (its docstring: arrays aligned with
predictions); `layout="tree"` hands the segments to `tree`, which shares
common prefixes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ac2_jax.segments.batch import (
    PackedBatch,
    empty_batch,
    feature_dtypes,
    packed_lengths,
    pad_rows,
    pow2_bucket,
    routing_shape,
    task_names,
)
from ac2_jax.segments.constraints import resolve_constraints
from ac2_jax.segments.segments import Segment
from ac2_jax.segments.tree import pack_segment_tree


def first_fit_decreasing(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Bins of item indices (each bin's lengths sum to <= seq_len), longest first.

    Items are placed longest first into the first row with room; each row
    lists its items in placement order (`pack_rows` sorts them).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for r, space in enumerate(free):
            if lengths[i] <= space:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(seq_len - lengths[i])
    return rows


def pack_segments(
    segments: Sequence[Segment],
    seq_len: int,
    *,
    truncate: bool = False,
    min_rows: int = 0,
    rows_multiple: int = 1,
    layout: str = "flat",
    min_tasks: int = 1,
    min_segments: int = 1,
    all_tasks: Sequence[str] | None = None,
    segment_offset: int = 0,
    min_masks: int = 1,
    constraint_masks: np.ndarray | None = None,
) -> PackedBatch:
    """Packs segments into rows of `seq_len` tokens.

    A segment longer than `seq_len` is an error unless `truncate=True`, which
    keeps its first `seq_len` tokens (the cut tokens leave the loss). Rows are
    padded up to `min_rows` and to a multiple of `rows_multiple` (e.g. the
    data-parallel device count). `layout="tree"` shares common prefixes (see
    `ac2_jax.segments.tree`). The static capacities `num_tasks` / `num_segments`
    are `pow2_bucket(count, min_tasks / min_segments)`: floors at least as large
    as the data keep them (and the compiled step) the same from batch to batch.

    One share of a global batch (a process of a multi-host learner packs only
    its own segments): `all_tasks` lists every task name of the global batch
    (task ids index it, so the same task has the same id on every process) and
    `segment_offset` is the global number of this share's first segment.

    Grammar masks (`ac2_jax.segments.constraints`): the segments' own tables
    become the batch's `constraint_masks` (`pow2_bucket(masks, min_masks)`
    rows); a share of a global batch passes the global table instead
    (`constraint_masks=`, ids already batch-wide). No mask: None, as before.
    """
    if all_tasks is not None or segment_offset:
        if layout != "flat":
            raise ValueError(
                "pack_segments: all_tasks / segment_offset (one share of a "
                "global batch) need layout='flat'"
            )
    if layout == "tree":
        return pack_segment_tree(
            segments,
            seq_len,
            truncate=truncate,
            min_rows=min_rows,
            rows_multiple=rows_multiple,
            min_tasks=min_tasks,
            min_segments=min_segments,
            min_masks=min_masks,
            constraint_masks=constraint_masks,
        )
    if layout != "flat":
        raise ValueError(f"pack_segments: layout must be 'flat' or 'tree', got {layout!r}")
    lengths = packed_lengths(segments, seq_len, truncate, "pack_segments")
    segments, table = resolve_constraints(segments, constraint_masks, min_masks, "pack_segments")

    names = task_names(segments) if all_tasks is None else tuple(all_tasks)
    task_index = {name: i for i, name in enumerate(names)}
    missing = sorted({s.task for s in segments} - set(task_index))
    if missing:
        raise ValueError(f"pack_segments: tasks {missing[:5]} are not in all_tasks")
    if segment_offset < 0:
        raise ValueError(f"pack_segments: segment_offset must be >= 0, got {segment_offset}")
    bins = pack_rows(lengths, seq_len)
    features = feature_dtypes(segments, "pack_segments")
    out = empty_batch(pad_rows(len(bins), min_rows, rows_multiple), seq_len, features)
    routed = routing_shape(segments, "pack_segments")
    if routed is not None:  # -1: not recorded (padding, segments without a record)
        out["routing"] = np.full((*out["tokens"].shape, *routed), -1, np.int32)
    for r, members in enumerate(bins):
        start = 0
        for local_id, i in enumerate(members, start=1):
            s = segments[i]
            write_segment(
                out, r, start, s, lengths[i], task_index[s.task], local_id, segment_offset + i
            )
            start += lengths[i]
    return PackedBatch(
        **out,
        constraint_masks=table,
        num_tasks=pow2_bucket(len(task_index), min_tasks),
        num_segments=pow2_bucket(segment_offset + len(segments), min_segments),
    )


def pack_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """First-fit-decreasing rows, each listing its items in index order (the
    segment order within the row)."""
    return [sorted(r) for r in first_fit_decreasing(lengths, seq_len)]


def write_segment(
    out: dict[str, np.ndarray],
    r: int,
    start: int,
    s: Segment,
    n: int,
    task_id: int,
    seg_id: int,
    seg_index: int,
) -> None:
    """Writes the first n tokens of `s` into row r of `out` at columns [start, start + n).

    out: `empty_batch` arrays [rows, seq_len]. Per-token arrays follow the
    prediction alignment of the module docstring: column start + j - 1 scores
    token j (j = 1..n-1); seg_id numbers the segment in its row (1..),
    seg_index in the batch.
    """
    sl, pred = slice(start, start + n), slice(start, start + n - 1)
    toks = s.tokens[:n]
    out["tokens"][r, sl] = toks
    out["targets"][r, pred] = toks[1:]
    out["positions"][r, sl] = np.arange(n)
    out["segment_ids"][r, sl] = seg_id
    out["loss_mask"][r, pred] = s.loss_mask[1:n]
    out["loss_weight"][r, sl] = s.weight
    for k in ("temperature", "top_k", "top_p"):
        out[k][r, pred] = getattr(s, k)[1:n]
    for k, v in s.features.items():
        out["features"][k][r, pred] = v[1:n]
    if s.routing is not None and "routing" in out:  # aligned with the inputs
        out["routing"][r, sl] = s.routing[:n]
    out["task_ids"][r, sl] = task_id
    out["segment_index"][r, sl] = seg_index
