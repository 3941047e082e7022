"""The packed batch: fixed-shape [rows, seq_len] arrays and the helpers that size them.

Everything here is host numpy; the batch is a pytree the learner ships to
devices. Per-token arrays are aligned with *predictions*: position p holds
the input token `tokens[p]` and what the model predicts there, `targets[p]`
(the next token of the same segment). `loss_mask[p]` COUNTS that prediction
(1 where `targets[p]` is an agent token, else 0; the merge multiplicity in a
tree) and `loss_weight[p]` is the factor its loss is multiplied by (the
segment's weight). So `logits[p]` is scored against `targets[p]` with no
shifting downstream. The packers (`packing`: flat rows, `tree`: shared
prefixes) fill it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from flax import struct

from ac2_jax.segments.segments import Segment


@struct.dataclass
class PackedBatch:
    """A packed batch; every array is [rows, seq_len].

    tokens, targets, positions (reset per segment), segment_ids (1.. within a
    row, 0 = padding): int32. loss_mask (the count of trained predictions,
    defines N_task), loss_weight (multiplies the loss): float32, aligned
    with targets. temperature, top_p
    (float32), top_k (int32): the sampling parameters the target was drawn
    with; the policy-gradient loss re-scores targets under them (1 / 0 / 1 =
    the raw distribution). task_ids: int32 index of the token's task in
    `task_names(segments)` (the loss's per-task groups). segment_index: int32
    global segment number (for `segment_mean`). subtree_end: int32, only for
    tree layouts (token k is seen by queries k..subtree_end[k]); None for flat.
    features: the segments' named per-token features ([rows, seq_len] each,
    float32 or int32, aligned with targets like loss_mask: column p holds the
    value of the token `targets[p]`; 0 off the trained predictions), e.g. the
    RL advantages and sampler log-probs (`ac2_jax.training.rl.features`). The
    packers carry them without reading them. constraint_masks: the batch's
    table of grammar masks, packed bits uint32 [K, ceil(V / 32)] (K a static
    capacity, a power of two) that the int32 feature `CONSTRAINT_ID` indexes
    (k >= 1: row k - 1; 0: unconstrained); None (no leaf) when no token is
    constrained (`ac2_jax.segments.constraints`). It is not row-aligned: the
    train step hands it whole to every micro-batch and device.
    routing: None (no leaf), or int32 [rows, seq_len, moe layers, k], the
    experts a mixture-of-experts sampler routed each token to, aligned with
    `tokens` (the inputs; unlike the per-prediction arrays): what the
    learner replays (`models.moe_decoder`, routing replay); -1 where not
    recorded (that token routes itself). Row-aligned like `tokens`, so it
    splits with the rows.

    num_tasks / num_segments are static capacities (the next power of two of
    the real counts; unused ids hold no tokens), so batches of similar size
    share one compiled train step.
    """

    tokens: np.ndarray
    targets: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    loss_mask: np.ndarray
    task_ids: np.ndarray
    segment_index: np.ndarray
    loss_weight: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    subtree_end: np.ndarray | None = None
    features: dict[str, np.ndarray] = struct.field(default_factory=dict)
    constraint_masks: np.ndarray | None = None
    routing: np.ndarray | None = None
    num_tasks: int = struct.field(pytree_node=False, default=0)
    num_segments: int = struct.field(pytree_node=False, default=0)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def feature(self, name: str) -> np.ndarray:
        """`features[name]`, or an error naming the features this batch has."""
        if name not in self.features:
            raise KeyError(
                f"PackedBatch has no feature {name!r} (it has {sorted(self.features)}); "
                "the segments packed into it must carry it (Segment.features)"
            )
        return self.features[name]

    @property
    def num_real_tokens(self) -> int:
        return int((np.asarray(self.segment_ids) > 0).sum())


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


def packed_lengths(
    segments: Sequence[Segment], seq_len: int, truncate: bool, who: str
) -> list[int]:
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
                f"more than seq_len={seq_len}; raise seq_len or pass truncate=True"
            )
        lengths.append(min(len(s), seq_len))
    return lengths


def routing_shape(segments: Sequence[Segment], who: str) -> tuple[int, int] | None:
    """(moe layers, k) of the segments' recorded routing; None when none has any."""
    shapes = {s.routing.shape[1:] for s in segments if s.routing is not None}
    if len(shapes) > 1:
        raise ValueError(f"{who}: segments record routing of different shapes {sorted(shapes)}")
    return next(iter(shapes), None)


def feature_dtypes(segments: Sequence[Segment], who: str) -> dict[str, np.dtype]:
    """The features every segment carries, with their dtypes; all must agree."""
    first = segments[0]
    want = {k: v.dtype for k, v in first.features.items()}
    for i, s in enumerate(segments):
        got = {k: v.dtype for k, v in s.features.items()}
        if got != want:
            raise ValueError(
                f"{who}: segment {i} ({s.task!r}) has features {sorted(got.items())} but "
                f"segment 0 ({first.task!r}) has {sorted(want.items())}; every segment of "
                "a batch must carry the same features"
            )
    return want


def empty_batch(
    rows: int, seq_len: int, features: Mapping[str, np.dtype] | None = None
) -> dict[str, Any]:
    """The zero arrays of a batch (`PackedBatch(**empty_batch(...))` fields),
    with a zero [rows, seq_len] array for each named feature."""
    z = lambda dt: np.zeros((rows, seq_len), dt)  # noqa: E731
    one = lambda: np.ones((rows, seq_len), np.float32)  # noqa: E731
    return dict(
        tokens=z(np.int32),
        targets=z(np.int32),
        positions=z(np.int32),
        segment_ids=z(np.int32),
        loss_mask=z(np.float32),
        task_ids=z(np.int32),
        segment_index=z(np.int32),
        loss_weight=one(),
        temperature=one(),
        top_k=z(np.int32),
        top_p=one(),
        features={k: z(dt) for k, dt in (features or {}).items()},
    )


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
    pad = empty_batch(extra, batch.shape[1], {k: v.dtype for k, v in batch.features.items()})
    features = pad.pop("features")
    if batch.subtree_end is not None:
        pad["subtree_end"] = np.tile(np.arange(batch.shape[1], dtype=np.int32), (extra, 1))
    changes: dict[str, Any] = {
        k: np.concatenate([np.asarray(getattr(batch, k)), v]) for k, v in pad.items()
    }
    changes["features"] = {
        k: np.concatenate([np.asarray(batch.features[k]), v]) for k, v in features.items()
    }
    if batch.routing is not None:  # padding rows record nothing
        r = np.asarray(batch.routing)
        changes["routing"] = np.concatenate([r, np.full((extra, *r.shape[1:]), -1, r.dtype)])
    return dataclasses.replace(batch, **changes)
