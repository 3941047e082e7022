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

from collections.abc import Sequence

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


def empty_batch(rows: int, seq_len: int) -> dict[str, np.ndarray]:
    z = lambda dt: np.zeros((rows, seq_len), dt)  # noqa: E731
    one = lambda: np.ones((rows, seq_len), np.float32)  # noqa: E731
    return dict(
        tokens=z(np.int32),
        targets=z(np.int32),
        positions=z(np.int32),
        segment_ids=z(np.int32),
        loss_mask=z(np.float32),
        advantages=z(np.float32),
        sampler_logprobs=z(np.float32),
        task_ids=z(np.int32),
        segment_index=z(np.int32),
        loss_weight=one(),
        temperature=one(),
        top_k=z(np.int32),
        top_p=one(),
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
    pad = empty_batch(extra, batch.shape[1])
    if batch.subtree_end is not None:
        pad["subtree_end"] = np.tile(np.arange(batch.shape[1], dtype=np.int32), (extra, 1))
    return batch.replace(
        **{k: np.concatenate([np.asarray(getattr(batch, k)), v]) for k, v in pad.items()}
    )
