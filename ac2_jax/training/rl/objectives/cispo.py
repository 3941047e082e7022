"""CISPO: clipped stop-gradient IS weight times the log-prob (gradient through every token)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ac2_jax.losses import cispo_loss
from ac2_jax.training.core.objectives import OBJECTIVES, PolicyGradientLoss


@OBJECTIVES.register("cispo")
@dataclasses.dataclass(frozen=True)
class CISPOLoss(PolicyGradientLoss):
    """CISPO, MiniMax et al. 2025, "MiniMax-M1" (arXiv 2506.13585), eq. 4-5:

        J = E[ 1/sum_i |o_i| sum_i sum_t sg(r^_i,t) A_i,t log pi(o_i,t) ],
        r^ = clip(pi / pi_old, 1 - eps_low, 1 + eps_high)

    (`losses.cispo_loss`). A clipped token keeps its gradient (only its weight
    is capped), unlike PPO's clip. Defaults: no lower bound (eps_low None, as
    the paper runs it), eps_high 4.0 (a cap of 5 on the weight: ScaleRL's
    eps_max = 5, TRL's epsilon_high=5.0 for loss_type="cispo"), pi_old the
    sampler (the weight is the importance weight against the behaviour
    policy), mode "token_mean" (the paper's 1/sum|o_i|). clip_eps, tis_cap and
    dual_clip do not apply and must stay None. Metric: cispo_clip_frac, the
    share of trained tokens whose weight was capped.
    """

    mode: str = "token_mean"
    clip_eps: float | tuple[float, float] | None = None  # type: ignore[assignment]
    tis_cap: float | None = None
    old_logprobs: str = "sampler"
    eps_low: float | None = None
    eps_high: float = 4.0

    def __post_init__(self):
        super().__post_init__()
        for name in ("clip_eps", "tis_cap", "dual_clip"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"CISPOLoss.{name} must be None: CISPO bounds its weight with eps_low / "
                    f"eps_high (got {name}={getattr(self, name)!r})"
                )
        if not self.eps_high > 0 or (self.eps_low is not None and not 0 <= self.eps_low < 1):
            raise ValueError(
                f"CISPOLoss: eps_high must be > 0 and eps_low None or in [0, 1), got "
                f"eps_low={self.eps_low!r}, eps_high={self.eps_high!r}"
            )

    def inert_fields(self) -> dict[str, str]:
        """eps_low / eps_high cannot cap a weight whose ratio is 1 (old_logprobs
        "detached"); tis_cap is refused outright above."""
        if self.old_logprobs == "detached":
            why = "the ratio pi / pi_old is 1, so the weight is never capped"
            return {"eps_low": why, "eps_high": why}
        return {}

    def bounds(self) -> tuple[str, ...]:
        return ("cispo_clip_frac",) if self.old_logprobs != "detached" else ()

    def surrogate(self, logp, old, sampler, advantages, mask, batch):
        return cispo_loss(logp, old, advantages, mask, self.eps_low, self.eps_high)

    def bound_metrics(self, logp, old, sampler, mask, advantages, batch):
        m = mask.astype(jnp.float32)
        n = jnp.maximum(m.sum(), 1.0)
        r = jnp.exp(logp - old)
        capped = r > 1.0 + self.eps_high
        if self.eps_low is not None:
            capped = capped | (r < 1.0 - self.eps_low)
        log_r = logp - sampler
        out = {"kl_to_sampler": ((jnp.exp(log_r) - 1.0 - log_r) * m).sum() / n}
        if self.bounds():
            out["cispo_clip_frac"] = (capped.astype(jnp.float32) * m).sum() / n
        return out
