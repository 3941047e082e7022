"""GRPO and Dr. GRPO: the PPO-clip surrogate with group-relative advantages."""

from __future__ import annotations

import dataclasses

from ac2_jax.training.core.objectives import OBJECTIVES, PolicyGradientLoss


@OBJECTIVES.register("grpo")
@dataclasses.dataclass(frozen=True)
class GRPOLoss(PolicyGradientLoss):
    """GRPO, Shao et al. 2024, "DeepSeekMath" (arXiv 2402.03300), eq. 3:

        J = E[ 1/G sum_i 1/|o_i| sum_t { min(r_i,t A_i,t, clip(r_i,t, 1-eps, 1+eps) A_i,t)
                                          - beta D_KL[pi || pi_ref] } ]
        r_i,t = pi(o_i,t) / pi_old(o_i,t),   A_i = (R_i - mean(R)) / std(R)  (eq. 3, 4)

    The PPO loss (`PolicyGradientLoss`) with the paper's choices as defaults:
    pi_old is the policy that sampled (old_logprobs="sampler": the ratio is the
    trust region against it), the mean over an attempt's tokens then over
    attempts (mode "task_mean", verl's seq-mean-token-mean; "token_mean",
    "task_sum" and "constant" are verl's other three), the KL as k3 with
    kl_coef = beta (the paper's 0.04; default 0 as in current practice). The
    advantage is the batch's: rl.batch.advantage kind "grpo" with
    rl.batch.normalize_std=true for eq. 4's std.
    """

    old_logprobs: str = "sampler"


@OBJECTIVES.register("dr_grpo")
@dataclasses.dataclass(frozen=True)
class DrGRPOLoss(PolicyGradientLoss):
    """Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv
    2503.20783), eq. 2 ("GRPO Done Right"):

        J = E[ 1/G sum_i sum_t min(r_i,t A_i, clip(r_i,t, 1-eps, 1+eps) A_i) ] / L_max,
        A_i = R_i - mean(R)                     (no std, no 1/|o_i|)

    GRPO without its two biases: no per-response length normaliser (mode
    "task_sum": the mean over attempts of each attempt's token SUM, divided by
    `normalizer` = L_max, the most tokens an attempt may generate, a constant
    so the loss scale never depends on lengths; TRL's loss_type="dr_grpo") and
    no std in the advantage (use rl.batch.advantage kind "dr_grpo", which
    refuses normalize_std). pi_old: the sampler, as in GRPO.
    """

    mode: str = "task_sum"
    old_logprobs: str = "sampler"

    def __post_init__(self):
        super().__post_init__()
        if self.normalizer is None or not self.normalizer > 0:
            raise ValueError(
                "DrGRPOLoss.normalizer must be the most tokens an attempt may generate "
                f"(Dr. GRPO's constant L_max, e.g. rollout.max_tokens x max_steps), got "
                f"{self.normalizer!r}"
            )
