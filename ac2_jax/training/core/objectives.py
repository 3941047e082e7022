"""Loss functions for the train step, and the token weights that make them exact
under sharding, pmap and gradient accumulation.

The normaliser is `ac2_jax.losses.loss_weights` (re-exported here): every
aggregation is linear in the per-token losses once its normalizers (per-task /
per-segment / total token counts) are fixed, and those depend only on the
batch, never on the params. So the step computes `w = loss_weights(full
batch)` once and the loss is `sum(w * per_token)` over any split of the rows:
micro-batches add up, pmap devices psum, and no gradient ever flows through a
collective.

A LossFn maps (logits [R, L, V], batch, extras) to (per_token [R, L],
metric_sums): each metric sum is `sum(loss_mask * value)` over the given rows;
the step divides by the global `sum(loss_mask)` (token-mean metrics).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp

from ac2_jax.losses import (MODES, loss_weights, policy_gradient_loss, policy_gradient_metrics,
                            token_entropy, token_logprobs)

OLD_LOGPROBS = ("detached", "sampler", "extras")


def behaviour_logprobs(logits: jax.Array, batch) -> jax.Array:
    """Learner log-probs [R, L] of batch.targets under the distribution the sampler drew
    them from (the batch's temperature / top_k / top_p), comparable to sampler_logprobs."""
    return token_logprobs(logits, batch.targets, temperature=batch.temperature,
                          top_k=batch.top_k, top_p=batch.top_p)


class LossFn(Protocol):
    """What the train step needs from a loss."""

    mode: str
    normalizer: float | None

    def __call__(self, logits: jax.Array, batch, extras: dict | None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]: ...


def _check_mode(name, mode):
    if mode not in MODES:
        raise ValueError(f"{name}.mode must be one of {MODES}, got {mode!r}")


@dataclasses.dataclass(frozen=True)
class SFTLoss:
    """Masked next-token NLL: l_t = -log p(target_t). Metric: entropy."""

    mode: str = "task_mean"
    normalizer: float | None = None
    entropy: bool = True

    def __post_init__(self):
        _check_mode("SFTLoss", self.mode)

    def __call__(self, logits, batch, extras=None):
        m = batch.loss_mask.astype(jnp.float32)
        per_token = -token_logprobs(logits, batch.targets)
        sums = {}
        if self.entropy:
            sums["entropy"] = (jax.lax.stop_gradient(token_entropy(logits)) * m).sum()
        return per_token, sums


@dataclasses.dataclass(frozen=True)
class PolicyGradientLoss:
    """Clipped policy-gradient loss with truncated importance weights.

    `old_logprobs` is where the PPO ratio's denominator comes from:
    "detached" (the current learner log-probs, gradient stopped: one update
    per batch, TIS then corrects learner vs sampler), "sampler" (the batch's
    sampler_logprobs) or "extras" (extras["old_logprobs"] [R, L], e.g. from
    `TrainStep.logprobs` before several updates on one batch).
    Metrics: entropy, clip_frac, kl_to_sampler.
    """

    mode: str = "task_mean"
    normalizer: float | None = None
    clip_eps: float | tuple[float, float] = 0.2
    tis_cap: float | None = 2.0
    old_logprobs: str = "detached"
    entropy: bool = True

    def __post_init__(self):
        _check_mode("PolicyGradientLoss", self.mode)
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"PolicyGradientLoss.old_logprobs must be one of {OLD_LOGPROBS}, "
                             f"got {self.old_logprobs!r}")

    def __call__(self, logits, batch, extras=None):
        m = batch.loss_mask.astype(jnp.float32)
        logp = behaviour_logprobs(logits, batch)
        if self.old_logprobs == "detached":
            old = jax.lax.stop_gradient(logp)
        elif self.old_logprobs == "sampler":
            old = batch.sampler_logprobs
        else:
            if not extras or "old_logprobs" not in extras:
                raise ValueError("PolicyGradientLoss(old_logprobs='extras') needs "
                                 "extras={'old_logprobs': [rows, seq_len]} in the step call")
            old = extras["old_logprobs"]
        per_token = policy_gradient_loss(logp, old, batch.sampler_logprobs, batch.advantages, m,
                                         clip_eps=self.clip_eps, tis_cap=self.tis_cap)
        # policy_gradient_metrics returns sum(m x) / max(sum m, 1); undo the division.
        means = policy_gradient_metrics(jax.lax.stop_gradient(logp), old, batch.sampler_logprobs,
                                        m, batch.advantages, clip_eps=self.clip_eps)
        n = jnp.maximum(m.sum(), 1.0)
        sums = {k: v * n for k, v in means.items()}
        if self.entropy:
            sums["entropy"] = (jax.lax.stop_gradient(token_entropy(logits)) * m).sum()
        return per_token, sums
