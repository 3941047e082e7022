"""GSPO: one importance ratio per sequence, clipped per sequence."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ac2_jax.losses import gspo_loss, sequence_log_ratio
from ac2_jax.training.core.objectives import OBJECTIVES, PolicyGradientLoss


@OBJECTIVES.register("gspo")
@dataclasses.dataclass(frozen=True)
class GSPOLoss(PolicyGradientLoss):
    """GSPO, Zheng et al. 2025 (arXiv 2507.18071), eq. 5-7:

        J = E[ 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_lo, 1 + eps_hi) A_i) ],
        s_i = exp( 1/|y_i| sum_t log(pi(y_i,t) / pi_old(y_i,t)) )

    in its GSPO-token form (eq. 13: same value and gradient, per-token
    advantages allowed): `losses.gspo_loss`. A sequence is one attempt (all
    its turns and rows). Defaults: the paper's clip (3e-4, 4e-4), pi_old the
    sampler, mode "task_mean" (the paper's 1/G). No per-token weight: tis_cap
    and dual_clip must stay None. Metric clip_frac: the share of trained tokens
    whose sequence ratio is clipped on the side that removes gradient.

    The sequence ratio needs every token of an attempt in one micro-batch:
    `RLConfig` refuses grad_accum > 1 with it (`needs_whole_attempts`). Under a
    mesh the batch is one global array, so a sharded attempt is summed whole.
    """

    clip_eps: float | tuple[float, float] = (3e-4, 4e-4)
    tis_cap: float | None = None
    old_logprobs: str = "sampler"

    needs_whole_attempts = True  # a class attribute, not a config field

    def __post_init__(self):
        super().__post_init__()
        for name in ("tis_cap", "dual_clip"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"GSPOLoss.{name} must be None: GSPO clips one ratio per sequence and "
                    f"has no per-token weight (got {getattr(self, name)!r})"
                )

    def bounds(self) -> tuple[str, ...]:
        return ("clip_frac",) if self.old_logprobs != "detached" else ()

    def surrogate(self, logp, old, sampler, advantages, mask, batch):
        return gspo_loss(
            logp, old, advantages, mask, batch.task_ids, batch.num_tasks, self.clip_eps
        )

    def bound_metrics(self, logp, old, sampler, mask, advantages, batch):
        lo, hi = _bounds(self.clip_eps)
        m = mask.astype(jnp.float32)
        n = jnp.maximum(m.sum(), 1.0)
        s = jnp.exp(sequence_log_ratio(logp, old, mask, batch.task_ids, batch.num_tasks))
        clipped = ((s > hi) & (advantages > 0)) | ((s < lo) & (advantages < 0))
        log_r = logp - sampler
        out = {"kl_to_sampler": ((jnp.exp(log_r) - 1.0 - log_r) * m).sum() / n}
        if "clip_frac" in self.bounds():
            out["clip_frac"] = (clipped.astype(jnp.float32) * m).sum() / n
        return out


def _bounds(clip_eps):
    low, high = clip_eps if isinstance(clip_eps, (tuple, list)) else (clip_eps, clip_eps)
    return 1.0 - low, 1.0 + high
