"""Packing segments into fixed-shape rows (first-fit decreasing).

Everything here is host numpy; the result is a pytree the learner ships to
devices. Per-token arrays are aligned with *predictions*: position p holds
the input token `tokens[p]` and what the model predicts there, `targets[p]`
(the next token of the same segment). `loss_mask[p]` COUNTS that prediction
(1 where `targets[p]` is an agent token, else 0; the merge multiplicity in a
tree) and `loss_weight[p]` is the factor its loss is multiplied by (the
segment's weight). So `logits[p]` is scored against `targets[p]` with no
shifting downstream.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from flax import struct

from ac2_jax.segments.segments import Segment


@struct.dataclass
class PackedBatch:
    """A packed batch; every array is [rows, seq_len].

    tokens, targets, positions (reset per segment), segment_ids (1.. within a
    row, 0 = padding): int32. loss_mask (the count of trained predictions,
    defines N_task), loss_weight (multiplies the loss), advantages,
    sampler_logprobs: float32, aligned with targets. temperature, top_p
    (float32), top_k (int32): the sampling parameters the target was drawn
    with; the policy-gradient loss re-scores targets under them (1 / 0 / 1 =
    the raw distribution). task_ids: int32 index of the token's task in
    `task_names(segments)` (the loss's per-task groups). segment_index: int32
    global segment number (for `segment_mean`). subtree_end: int32, only for
    tree layouts (token k is seen by queries k..subtree_end[k]); None for flat.

    num_tasks / num_segments are static capacities (the next power of two of
    the real counts; unused ids hold no tokens), so batches of similar size
    share one compiled train step.
    """

    tokens: np.ndarray
    targets: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    sampler_logprobs: np.ndarray
    task_ids: np.ndarray
    segment_index: np.ndarray
    loss_weight: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    subtree_end: np.ndarray | None = None
    num_tasks: int = struct.field(pytree_node=False, default=0)
    num_segments: int = struct.field(pytree_node=False, default=0)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    @property
    def num_real_tokens(self) -> int:
        return int((np.asarray(self.segment_ids) > 0).sum())


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


def task_names(segments: Sequence[Segment]) -> tuple[str, ...]:
    """The tasks of `segments` in task-id order (the batch's `task_ids`)."""
    return tuple(sorted({s.task for s in segments}))


def pow2_bucket(n: int, lo: int = 1, hi: int | None = None) -> int:
    """Smallest lo * 2**k >= n (k >= 0), capped at hi: static shapes, few compiles.

    The one bucketing helper: static group capacities (lo=1: the next power of
    two), sampler rows / cache lengths / prefill lengths.
    """
    b = max(int(lo), 1)
    while b < n:
        b *= 2
    return b if hi is None else min(b, int(hi))


def packed_lengths(segments: Sequence[Segment], seq_len: int, truncate: bool,
                   who: str) -> list[int]:
    """Each segment's length in the batch; errors name the segment at fault."""
    if not segments:
        raise ValueError(f"{who}: no segments to pack")
    lengths = []
    for i, s in enumerate(segments):
        if len(s) == 0:
            raise ValueError(f"{who}: segment {i} ({s.task!r}) is empty")
        if len(s) > seq_len and not truncate:
            raise ValueError(
                f"{who}: segment {i} ({s.task!r}) has {len(s)} tokens, "
                f"more than seq_len={seq_len}; raise seq_len or pass truncate=True")
        lengths.append(min(len(s), seq_len))
    return lengths


def empty_batch(rows: int, seq_len: int) -> dict[str, np.ndarray]:
    z = lambda dt: np.zeros((rows, seq_len), dt)  # noqa: E731
    one = lambda: np.ones((rows, seq_len), np.float32)  # noqa: E731
    return dict(tokens=z(np.int32), targets=z(np.int32), positions=z(np.int32),
                segment_ids=z(np.int32), loss_mask=z(np.float32),
                advantages=z(np.float32), sampler_logprobs=z(np.float32),
                task_ids=z(np.int32), segment_index=z(np.int32), loss_weight=one(),
                temperature=one(), top_k=z(np.int32), top_p=one())


def pad_rows(rows: int, min_rows: int, rows_multiple: int) -> int:
    rows = max(rows, min_rows, 1)
    return -(-rows // rows_multiple) * rows_multiple


def pad_batch_rows(batch: PackedBatch, rows: int) -> PackedBatch:
    """`batch` with empty rows appended up to `rows` (as `empty_batch` makes them:
    no tokens, temperature 1; a tree row's slots see only themselves)."""
    extra = rows - batch.shape[0]
    if extra < 0:
        raise ValueError(f"pad_batch_rows: the batch has {batch.shape[0]} rows, more than {rows}")
    if extra == 0:
        return batch
    pad = empty_batch(extra, batch.shape[1])
    if batch.subtree_end is not None:
        pad["subtree_end"] = np.tile(np.arange(batch.shape[1], dtype=np.int32), (extra, 1))
    return batch.replace(**{k: np.concatenate([np.asarray(getattr(batch, k)), v])
                            for k, v in pad.items()})


def pack_segments(segments: Sequence[Segment], seq_len: int, *,
                  truncate: bool = False, min_rows: int = 0,
                  rows_multiple: int = 1, layout: str = "flat", min_tasks: int = 1,
                  min_segments: int = 1, all_tasks: Sequence[str] | None = None,
                  segment_offset: int = 0) -> PackedBatch:
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
    """
    if all_tasks is not None or segment_offset:
        if layout != "flat":
            raise ValueError("pack_segments: all_tasks / segment_offset (one share of a "
                             "global batch) need layout='flat'")
    if layout == "tree":
        from ac2_jax.segments.tree import pack_segment_tree
        return pack_segment_tree(segments, seq_len, truncate=truncate,
                                 min_rows=min_rows, rows_multiple=rows_multiple,
                                 min_tasks=min_tasks, min_segments=min_segments)
    if layout != "flat":
        raise ValueError(f"pack_segments: layout must be 'flat' or 'tree', got {layout!r}")
    lengths = packed_lengths(segments, seq_len, truncate, "pack_segments")

    names = task_names(segments) if all_tasks is None else tuple(all_tasks)
    task_index = {name: i for i, name in enumerate(names)}
    missing = sorted({s.task for s in segments} - set(task_index))
    if missing:
        raise ValueError(f"pack_segments: tasks {missing[:5]} are not in all_tasks")
    if segment_offset < 0:
        raise ValueError(f"pack_segments: segment_offset must be >= 0, got {segment_offset}")
    bins = pack_rows(lengths, seq_len)
    out = empty_batch(pad_rows(len(bins), min_rows, rows_multiple), seq_len)
    for r, members in enumerate(bins):
        start = 0
        for local_id, i in enumerate(members, start=1):
            s = segments[i]
            write_segment(out, r, start, s, lengths[i], task_index[s.task], local_id,
                          segment_offset + i)
            start += lengths[i]
    return PackedBatch(**out, num_tasks=pow2_bucket(len(task_index), min_tasks),
                       num_segments=pow2_bucket(segment_offset + len(segments), min_segments))


def pack_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """First-fit-decreasing rows, each listing its items in index order (the
    segment order within the row)."""
    return [sorted(r) for r in first_fit_decreasing(lengths, seq_len)]


def write_segment(out: dict[str, np.ndarray], r: int, start: int, s: Segment, n: int,
                  task_id: int, seg_id: int, seg_index: int) -> None:
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
    out["sampler_logprobs"][r, pred] = s.sampler_logprobs[1:n]
    for k in ("temperature", "top_k", "top_p"):
        out[k][r, pred] = getattr(s, k)[1:n]
    out["advantages"][r, sl] = s.advantage
    out["task_ids"][r, sl] = task_id
    out["segment_index"][r, sl] = seg_index
