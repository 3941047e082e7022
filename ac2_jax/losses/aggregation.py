"""Turning per-token losses into one batch loss (pure, jit-able).

`task_mean` (default) is the design's token-weighted task loss:
  L_task = sum_{s,t in task} m_t l_t / N_task,   loss = mean over tasks.
Per-task sums come from `jax.ops.segment_sum` over the batch's `task_ids`, so
any packing of the same segments gives the same value. Under `pmap` pass
`axis_name` and the per-task sums are summed across devices first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MODES = ("task_mean", "token_mean", "segment_mean", "constant")


def _grouped_mean(weighted, mask, group_ids, num_groups, axis_name):
    sums = jax.ops.segment_sum(weighted.ravel(), group_ids.ravel(), num_segments=num_groups)
    counts = jax.ops.segment_sum(mask.ravel(), group_ids.ravel(), num_segments=num_groups)
    if axis_name is not None:
        sums = jax.lax.psum(sums, axis_name)
        counts = jax.lax.psum(counts, axis_name)
    present = counts > 0
    per_group = jnp.where(present, sums / jnp.where(present, counts, 1.0), 0.0)
    return per_group.sum() / jnp.maximum(present.sum(), 1)


def aggregate_loss(per_token: jax.Array, batch, mode: str = "task_mean", *,
                   normalizer: float | None = None, axis_name: str | None = None) -> jax.Array:
    """Batch loss from per-token losses.

    per_token: [R, L] loss of predicting `batch.targets`. `batch` supplies
    loss_mask [R, L] (weights), task_ids / segment_index [R, L] and the static
    num_tasks / num_segments (a `PackedBatch`). Modes: task_mean (default),
    token_mean (all agent tokens of the batch), segment_mean (mean of L_s),
    constant (sum / `normalizer`, Dr.GRPO style; default R*L). Returns a scalar.
    """
    mask = batch.loss_mask.astype(jnp.float32)
    weighted = per_token.astype(jnp.float32) * mask
    if mode == "task_mean":
        return _grouped_mean(weighted, mask, batch.task_ids, batch.num_tasks, axis_name)
    if mode == "segment_mean":
        if getattr(batch, "subtree_end", None) is not None:
            raise ValueError("aggregate_loss: segment_mean is undefined on tree-packed batches "
                             "(shared tokens belong to several segments); use task_mean")
        return _grouped_mean(weighted, mask, batch.segment_index, batch.num_segments, axis_name)
    total, count = weighted.sum(), mask.sum()
    if axis_name is not None:
        total = jax.lax.psum(total, axis_name)
        count = jax.lax.psum(count, axis_name)
    if mode == "token_mean":
        return total / jnp.maximum(count, 1e-8)
    if mode == "constant":
        if normalizer is None:
            normalizer = float(mask.size)
            if axis_name is not None:
                normalizer = normalizer * jax.lax.psum(1, axis_name)
        return total / normalizer
    raise ValueError(f"aggregate_loss: mode must be one of {MODES}, got {mode!r}")
