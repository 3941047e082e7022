"""GSPO: the clipped objective on one importance ratio per sequence (pure, jit-able).

Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv 2507.18071):

    s_i(theta) = (pi(y_i | x) / pi_old(y_i | x)) ^ (1 / |y_i|)
               = exp( 1/|y_i| sum_t log(pi(y_i,t) / pi_old(y_i,t)) )            (eq. 7)
    J = E[ 1/G sum_i min( s_i A_i, clip(s_i, 1 - eps_lo, 1 + eps_hi) A_i ) ]      (eq. 5)

computed in the paper's GSPO-token form (eq. 13-14): per token
s_i,t = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)], whose value is s_i and whose
gradient is s_i grad log pi(y_i,t); averaged over the sequence's tokens (the
`task_mean` aggregation) this is GSPO's value and gradient, and it takes
per-token advantages A_i,t as they come.

A "sequence" here is one attempt: every trained token with the same `task_ids`
(all turns and rows of a multi-row trace; a tree-packed token counts its
`loss_mask` multiplicity m_t, so 1/|y_i| sum_t becomes sum_t m_t / sum_t m_t).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ac2_jax.losses.policy_gradient import _clip_range


def sequence_log_ratio(
    logp: jax.Array, old_logp: jax.Array, mask: jax.Array, task_ids: jax.Array, num_tasks: int
) -> jax.Array:
    """Per token [R, L]: the m-weighted mean of log(pi / pi_old) over the trained tokens
    of its task, sum_t m_t (logp_t - old_t) / sum_t m_t (0 where a task has none).

    All of an attempt's tokens must be in the arrays given (one micro-batch)."""
    m = mask.astype(jnp.float32)
    d = jnp.where(m > 0, (logp - old_logp).astype(jnp.float32), 0.0) * m
    ids = task_ids.ravel()
    num = jax.ops.segment_sum(d.ravel(), ids, num_segments=num_tasks)
    den = jax.ops.segment_sum(m.ravel(), ids, num_segments=num_tasks)
    return (num / jnp.maximum(den, 1e-8))[task_ids]


def gspo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    task_ids: jax.Array,
    num_tasks: int,
    clip_eps: float | tuple[float, float] = (3e-4, 4e-4),
) -> jax.Array:
    """Per-token GSPO(-token) loss [R, L] (module docstring), zero where mask == 0:

        l_t = -min(s~_t A_t, clip(s~_t, 1 - eps_lo, 1 + eps_hi) A_t),
        s~_t = exp(sg[log s_i] + logp_t - sg[logp_t]),
        log s_i = sequence_log_ratio(...) of the token's task.

    Aggregate with mode "task_mean" for the paper's 1/G sum_i (each attempt's
    tokens average to its sequence loss). clip_eps: eps or (eps_lo, eps_hi);
    the paper's defaults are (3e-4, 4e-4): a sequence ratio stays much closer to
    1 than token ratios do.
    """
    lo, hi = _clip_range(clip_eps)
    log_s = jax.lax.stop_gradient(sequence_log_ratio(logp, old_logp, mask, task_ids, num_tasks))
    s = jnp.exp(log_s + logp - jax.lax.stop_gradient(logp))
    surrogate = jnp.minimum(s * advantages, jnp.clip(s, lo, hi) * advantages)
    return jnp.where(mask > 0, -surrogate, 0.0)
