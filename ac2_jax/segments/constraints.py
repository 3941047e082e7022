"""Grammar-constrained tokens for the learner: per-token mask ids and one mask table per batch.

A token the sampler drew under a grammar (constrained decoding) came from the
masked distribution: logits outside the grammar's allowed set -> -inf, then
`ac2_jax.losses.sampling_logits`, then log_softmax. The learner re-scores it
the same way (`ac2_jax.losses.constrain_logits`), so an on-policy importance
ratio is exactly 1. What it needs, host side:

    Segment.features[CONSTRAINT_ID]   int32 [n]: 0 = unconstrained, k >= 1 = the
                                      allowed set is row k - 1 of the table
    Segment.constraint_masks          uint32 [m, W]: the segment's own table
                                      (`segments_from_trace(constraint_masks=)`)
    PackedBatch.constraint_masks      uint32 [K, W]: the batch's table (ids
                                      renumbered batch-wide, each distinct mask
                                      stored once, K = a power of two: a static
                                      capacity, like num_segments); None when no
                                      token of the batch is constrained

A mask is packed bits (`mask_bits`: W = ceil(V / 32) words, 18.5 KiB at
V = 151,936, where a bool row is 148 KiB). Ids follow the features' alignment in the batch:
column p holds the id of token `targets[p]`. The tree packer merges trained
tokens only where their features agree, so tokens under different masks
never merge (identical masks share one id, which is exact: same context,
same mask, same log-prob).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ac2_jax.segments.batch import pow2_bucket
from ac2_jax.segments.mask_bits import MaskTable
from ac2_jax.segments.segments import CONSTRAINT_ID, Segment


def merge_constraint_tables(
    segments: Sequence[Segment], who: str = "merge_constraint_tables"
) -> tuple[list[Segment], np.ndarray | None]:
    """Segments' own mask tables -> (segments with batch-wide ids and no own table,
    the batch table uint32 [n, W]) or (segments, None) when none has a table.

    Every segment of the result carries CONSTRAINT_ID (0s where it had none);
    equal masks get one id. Deterministic in the segments' order, so every
    process of a multi-host learner builds the same table.
    """
    if not any(s.constraint_masks is not None for s in segments):
        return list(segments), None
    table = MaskTable()
    out = []
    for i, s in enumerate(segments):
        if s.constraint_masks is None:
            ids = s.features.get(CONSTRAINT_ID)
            if ids is not None and np.any(ids):
                raise ValueError(
                    f"{who}: segment {i} ({s.task!r}) has constraint ids but no "
                    "constraint_masks to look them up in"
                )
            new = np.zeros(len(s), np.int32)
        else:
            local = np.r_[0, table.add(s.constraint_masks, who)].astype(np.int32)
            new = local[s.features[CONSTRAINT_ID]]  # id 0 stays 0
        out.append(s.with_constraints(new, None))
    return out, table.table()


def resolve_constraints(
    segments: Sequence[Segment],
    table: np.ndarray | None,
    min_masks: int,
    who: str,
) -> tuple[list[Segment], np.ndarray | None]:
    """What the packers pack: (segments, the batch table padded to pow2_bucket(n,
    min_masks) rows, or None).

    table None: the segments' own tables are merged (`merge_constraint_tables`).
    table given (one share of a global batch, ids already batch-wide, e.g.
    `training.rl.pack_rl_batch`): segments must carry no own table; those
    without ids get 0s. Ids past the table are an error.
    """
    if table is None:
        segments, table = merge_constraint_tables(segments, who)
        if table is None:
            for i, s in enumerate(segments):
                ids = s.features.get(CONSTRAINT_ID)
                if ids is not None and np.any(ids):
                    raise ValueError(
                        f"{who}: segment {i} ({s.task!r}) has constraint ids but the batch "
                        "has no mask table: give the segment its constraint_masks, or "
                        "pass the batch's table (constraint_masks=)"
                    )
            return list(segments), None
    else:
        table = np.asarray(table)
        if table.dtype != np.uint32 or table.ndim != 2:
            raise ValueError(
                f"{who}: constraint_masks must be the packed table uint32 [K, W] "
                f"(segments.pack_mask_bits), got {table.dtype} {table.shape}"
            )
        fixed = []
        for i, s in enumerate(segments):
            if s.constraint_masks is not None:
                raise ValueError(
                    f"{who}: segment {i} ({s.task!r}) has its own constraint_masks and "
                    "the batch's table was given too; merge them first "
                    "(merge_constraint_tables)"
                )
            ids = s.features.get(CONSTRAINT_ID)
            if ids is None:
                s = s.with_constraints(np.zeros(len(s), np.int32), None)
            elif ids.max(initial=0) > len(table):
                raise ValueError(
                    f"{who}: segment {i} ({s.task!r}) has constraint id {ids.max()} but "
                    f"the table holds {len(table)} masks"
                )
            fixed.append(s)
        segments = fixed
    capacity = pow2_bucket(len(table), max(int(min_masks), 1))
    padded = np.zeros((capacity, table.shape[1]), np.uint32)
    padded[: len(table)] = table
    return list(segments), padded
