"""DAPO: asymmetric clip-higher, token-level loss (overlong shaping is the batch's)."""

from __future__ import annotations

import dataclasses

from ac2_jax.training.core.objectives import OBJECTIVES, PolicyGradientLoss


@OBJECTIVES.register("dapo")
@dataclasses.dataclass(frozen=True)
class DAPOLoss(PolicyGradientLoss):
    """DAPO, Yu et al. 2025 (arXiv 2503.14476), eq. 8:

        J = E[ 1/sum_i |o_i| sum_i sum_t min(r_i,t A_i,t,
                                             clip(r_i,t, 1 - eps_low, 1 + eps_high) A_i,t) ]

    with eps_low = 0.2, eps_high = 0.28 ("clip-higher", section 3.1), the
    token-level mean over the whole batch (mode "token_mean", section 3.3), no
    KL (kl_coef 0), pi_old the sampler. DAPO's other two parts are batch
    settings: dynamic sampling (`rl.dynamic_sampling`, section 3.2) and overlong
    reward shaping (`rl.batch.overlong`, eq. 13: `training.rl.data.OverlongShaping`).
    """

    mode: str = "token_mean"
    clip_eps: float | tuple[float, float] = (0.2, 0.28)
    old_logprobs: str = "sampler"
