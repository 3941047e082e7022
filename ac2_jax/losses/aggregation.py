"""Turning per-token losses into one batch loss: the one normaliser (pure, jit-able).

Counts and weights are different arrays of the batch:
  loss_mask m_t   the COUNT of trained predictions at t (1 per agent token; the
                  tree-merge multiplicity where tokens are shared). It defines
                  the normalisers N_task, N_segment, N_batch.
  loss_weight w_t what multiplies the loss (segment weight: staleness
                  down-weighting, example weights); None means 1.
`task_mean` (default) is the design's token-weighted task loss, where a "task"
is what `task_ids` index: in RL one trace, i.e. one attempt (one of a
problem's G attempts); in SFT and distillation what their data names as the
task (e.g. all examples of one trace):
  L_task = sum_{t in task} w_t m_t l_t / N_task,  N_task = sum_{t in task} m_t,
  loss = mean of L_task over the tasks (attempts) present.
Every attempt with a trained token weighs the same, so in RL a problem with 8
attempts in the batch weighs 4x one with 2, and attempts with advantage 0 stay
in the mean unless left out (`BatchConfig.drop_zero_advantage`). RL's
`BatchConfig.mean_over="problem"` makes it a mean over problems (the mean over
a group's attempts, then over groups) through the segment weights.
A weight therefore scales its tokens' loss; it never cancels out.

`loss_weights` returns per-token factors c [R, L] with loss = sum(c * l). They
depend only on the batch (never on params), so the loss is linear in l over
any split of the rows: micro-batches add up, pmap devices psum (pass
`axis_name`: counts are summed across devices first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MODES = ("task_mean", "task_sum", "token_mean", "segment_mean", "constant")
# verl's `loss_agg_mode` names (verl/trainer/ppo/core_algos.py `agg_loss`) -> ours. verl's
# "seq" is one response; here it is what `task_ids` index (in RL one attempt).
VERL_MODES = {
    "token-mean": "token_mean",
    "seq-mean-token-mean": "task_mean",
    "seq-mean-token-sum": "task_sum",
    "seq-mean-token-sum-norm": "constant",
}


def resolve_mode(mode: str) -> str:
    """`mode` as one of `MODES` (verl's spellings, `VERL_MODES`, map to ours); an
    unknown mode is a ValueError naming both lists."""
    mode = VERL_MODES.get(mode, mode)
    if mode not in MODES:
        raise ValueError(
            f"loss mode must be one of {MODES} (or verl's {tuple(VERL_MODES)}), got {mode!r}"
        )
    return mode


def _psum(x, axis_name):
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def _per_group(mask, group_ids, num_groups, axis_name):
    """1 / (count of the token's group) / (number of groups present), per token."""
    counts = _psum(
        jax.ops.segment_sum(mask.ravel(), group_ids.ravel(), num_segments=num_groups), axis_name
    )
    present = counts > 0
    inv = jnp.where(present, 1.0 / jnp.where(present, counts, 1.0), 0.0)
    return inv[group_ids] / jnp.maximum(present.sum(), 1)


def loss_weights(
    batch, mode: str = "task_mean", *, normalizer: float | None = None, axis_name: str | None = None
) -> jax.Array:
    """Per-token factors c [R, L] with batch loss = sum(c * per_token).

    batch: a `PackedBatch` (loss_mask, loss_weight, task_ids, segment_index,
    num_tasks, num_segments). Modes: task_mean (default: every task id, in RL
    every attempt, weighs the same; verl's seq-mean-token-mean), task_sum (the
    mean over tasks of each task's token SUM, divided by `normalizer` when
    given: verl's seq-mean-token-sum; with normalizer = the max tokens an
    attempt may generate, Dr. GRPO's 1/G sum_i sum_t l / L_max, TRL's
    loss_type="dr_grpo"), token_mean (all trained tokens of the
    batch; verl's token-mean, DAPO's token-level loss), segment_mean (mean of L_s; undefined on tree
    batches, where a shared token belongs to several segments), constant
    (sum / `normalizer`, verl's seq-mean-token-sum-norm: the normaliser must be given, e.g. the
    max generation length, so the loss scale never depends on padding).
    """
    if VERL_MODES.get(mode, mode) not in MODES:
        raise ValueError(f"loss_weights: mode must be one of {MODES}, got {mode!r}")
    mode = VERL_MODES.get(mode, mode)
    count = batch.loss_mask.astype(jnp.float32)
    weight = getattr(batch, "loss_weight", None)
    weighted = count if weight is None else count * weight.astype(jnp.float32)
    if mode == "task_mean":
        return weighted * _per_group(count, batch.task_ids, batch.num_tasks, axis_name)
    if mode == "task_sum":
        if normalizer is not None and not normalizer > 0:
            raise ValueError(f"mode='task_sum': normalizer must be None or > 0, got {normalizer!r}")
        counts = _psum(
            jax.ops.segment_sum(
                count.ravel(), batch.task_ids.ravel(), num_segments=batch.num_tasks
            ),
            axis_name,
        )
        tasks = jnp.maximum((counts > 0).sum(), 1)
        return weighted / tasks / (1.0 if normalizer is None else normalizer)
    if mode == "segment_mean":
        if getattr(batch, "subtree_end", None) is not None:
            raise ValueError(
                "segment_mean is undefined on tree-packed batches (shared tokens "
                "belong to several segments); use task_mean or layout='flat'"
            )
        return weighted * _per_group(count, batch.segment_index, batch.num_segments, axis_name)
    if mode == "token_mean":
        return weighted / jnp.maximum(_psum(count.sum(), axis_name), 1e-8)
    if normalizer is None or not normalizer > 0:
        raise ValueError(
            f"mode='constant' needs normalizer > 0 (e.g. the max tokens a task may "
            f"generate), got {normalizer!r}"
        )
    return weighted / normalizer


def aggregate_loss(
    per_token: jax.Array,
    batch,
    mode: str = "task_mean",
    *,
    normalizer: float | None = None,
    axis_name: str | None = None,
) -> jax.Array:
    """Batch loss from per-token losses [R, L]: sum(loss_weights(batch) * per_token).

    Under pmap (`axis_name`) every device gets the global loss. Returns a scalar.
    """
    c = loss_weights(batch, mode, normalizer=normalizer, axis_name=axis_name)
    return _psum((c * per_token.astype(jnp.float32)).sum(), axis_name)
