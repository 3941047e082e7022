"""Group advantages and the clipped policy-gradient loss (pure, jit-able)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_advantages(
    rewards: jax.Array,
    group_ids: jax.Array,
    normalize_std: bool = False,
    eps: float = 1e-6,
    std_ddof: int = 0,
) -> jax.Array:
    """A = R - mean(R of the group) [/ (std of the group + eps)].

    rewards: [B] float; group_ids: [B] int in [0, B). Returns [B] (fp32).
    A group whose rewards are all equal (one attempt, or a tie) gets exactly 0:
    its fp32 mean need not equal a reward fp32 cannot hold (8 x 0.7 leaves a
    ~6e-8 residue, which a std of the same size would blow up to +-0.06 of one
    sign), so ties are detected exactly (max == min) and zeroed, never left to
    the arithmetic. The std is the population std (`std_ddof=0`, divides by n);
    `std_ddof=1` gives the sample std (divides by n - 1).
    """
    rewards = rewards.astype(jnp.float32)
    n = rewards.shape[0]
    counts = jax.ops.segment_sum(jnp.ones_like(rewards), group_ids, num_segments=n)
    means = jax.ops.segment_sum(rewards, group_ids, num_segments=n) / jnp.maximum(counts, 1.0)
    hi = jax.ops.segment_max(rewards, group_ids, num_segments=n)
    lo = jax.ops.segment_min(rewards, group_ids, num_segments=n)
    tied = (hi == lo)[group_ids]
    centered = jnp.where(tied, 0.0, rewards - means[group_ids])
    if not normalize_std:
        return centered
    var = jax.ops.segment_sum(centered**2, group_ids, num_segments=n) / jnp.maximum(
        counts - std_ddof, 1.0
    )
    return centered / (jnp.sqrt(var)[group_ids] + eps)


def _clip_range(clip_eps):
    if isinstance(clip_eps, (tuple, list)):
        low, high = clip_eps
    else:
        low = high = clip_eps
    return 1.0 - low, 1.0 + high


def _check_dual_clip(dual_clip):
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(
            f"dual_clip must be None or > 1 (Ye et al. 2020 use 3: the loss of a token "
            f"with A < 0 is bounded by dual_clip x |A|), got {dual_clip!r}"
        )


def policy_gradient_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    sampler_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    clip_eps: float | tuple[float, float] = 0.2,
    tis_cap: float | None = 2.0,
    dual_clip: float | None = None,
) -> jax.Array:
    """Per-token decoupled-PPO loss: a clipped ratio against `old_logp` (the proximal
    policy), the importance weight of the proximal against the sampler's policy.

    l_t = -S_t * w_t with
      r_t = exp(logp - old_logp)
      S_t = min(r_t A_t, clip(r_t, 1-eps_lo, 1+eps_hi) A_t)               (PPO clip)
      S_t = max(S_t, c A_t) where A_t < 0, c = dual_clip                 (dual clip)
      w_t = min(exp(old_logp - sampler_logp), tis_cap)   (no gradient; TIS)
    This is decoupled PPO (Hilton et al. 2021) with the proximal-to-behaviour
    weight truncated at tis_cap (tis_cap=None: w = 1, no correction; inf: the
    paper's untruncated weight) and the dual clip of Ye et al. 2020 (c > 1:
    a token with A < 0 whose ratio exceeds c gets no gradient, its loss is
    bounded by c |A|; None: no dual clip).

    Which bound acts depends on `old_logp`: the learner's own log-probs with
    the gradient stopped (one update per batch) make r = 1, so neither clip can
    bind and only TIS bounds the update; the sampler's log-probs make r the
    ratio to the behaviour policy (a trust region against it, the importance
    correction kept in r, w = 1); the pre-update log-probs of several updates
    on one batch make r the ratio to those. All inputs [..., L]; `clip_eps`
    may be (low, high). Returns [..., L], zero where mask == 0 (aggregate with
    `aggregate_loss`).
    """
    _check_dual_clip(dual_clip)
    lo, hi = _clip_range(clip_eps)
    ratio = jnp.exp(logp - old_logp)
    surrogate = jnp.minimum(ratio * advantages, jnp.clip(ratio, lo, hi) * advantages)
    if dual_clip is not None:
        surrogate = jnp.where(
            advantages < 0, jnp.maximum(surrogate, dual_clip * advantages), surrogate
        )
    loss = -surrogate
    if tis_cap is not None:
        w = jnp.minimum(jnp.exp(old_logp - sampler_logp), tis_cap)
        loss = loss * jax.lax.stop_gradient(w)
    return jnp.where(mask > 0, loss, 0.0)


def policy_gradient_metrics(
    logp,
    old_logp,
    sampler_logp,
    mask,
    advantages,
    clip_eps=0.2,
    *,
    dual_clip: float | None = None,
    tis_cap: float | None = None,
) -> dict:
    """Token-mean diagnostics: what each bound removed, and KL(sampler || learner).

    clip_frac counts tokens whose gradient the clip removes: ratio > 1 + eps_hi
    with A > 0, or ratio < 1 - eps_lo with A < 0 (the other side of the clip
    has no effect under the min). With `dual_clip` c: dual_clip_frac, tokens
    with A < 0 and ratio > c (the dual clip removes their gradient). With
    `tis_cap` C: tis_frac, tokens whose weight exp(old - sampler) exceeds C
    (truncated to C). kl_to_sampler: the k3 estimate of KL(sampler || learner).
    """
    lo, hi = _clip_range(clip_eps)
    m = mask.astype(jnp.float32)
    n = jnp.maximum(m.sum(), 1.0)
    ratio = jnp.exp(logp - old_logp)
    clipped = (((ratio > hi) & (advantages > 0)) | ((ratio < lo) & (advantages < 0))).astype(
        jnp.float32
    )
    log_r = logp - sampler_logp  # k3 estimator of KL(sampler || learner)
    k3 = jnp.exp(log_r) - 1.0 - log_r
    out = {"clip_frac": (clipped * m).sum() / n, "kl_to_sampler": (k3 * m).sum() / n}
    if dual_clip is not None:
        dual = ((advantages < 0) & (ratio > dual_clip)).astype(jnp.float32)
        out["dual_clip_frac"] = (dual * m).sum() / n
    if tis_cap is not None:
        truncated = (jnp.exp(old_logp - sampler_logp) > tis_cap).astype(jnp.float32)
        out["tis_frac"] = (truncated * m).sum() / n
    return out
