"""GRPO's group-relative advantage, and Dr. GRPO's (no std)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ac2_jax.training.rl.advantages.base import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    group_members,
    spread,
)


@ADVANTAGE_ESTIMATORS.register("grpo")
@dataclasses.dataclass(frozen=True)
class GRPOAdvantage(AdvantageEstimator):
    """A_i = R_i - mean_g(R), divided by (std_g(R) + eps) with rl.batch.normalize_std
    (the population std, or the sample std with std_ddof=1).

    Shao et al. 2024, "DeepSeekMath" (arXiv 2402.03300), section 4.1.2: outcome
    supervision's A_i = (r_i - mean(r)) / std(r). The default (normalize_std
    False) is the library's behaviour before the menu, which is also Dr.
    GRPO's advantage. Tied groups and lone attempts: exactly 0.
    """

    def check(self, config) -> None:
        pass  # normalize_std and std_ddof are its settings

    def __call__(self, rewards, groups, *, normalize_std=False, std_ddof=0, eps=1e-6):
        adv = np.zeros(len(rewards), np.float64)
        for idx in group_members(groups).values():
            r = rewards[idx]
            if not spread(r):
                continue
            a = r - r.mean()
            if normalize_std:
                a = a / (r.std(ddof=std_ddof) + eps)
            adv[idx] = a
        return adv


@ADVANTAGE_ESTIMATORS.register("dr_grpo")
@dataclasses.dataclass(frozen=True)
class DrGRPOAdvantage(GRPOAdvantage):
    """A_i = R_i - mean_g(R): GRPO's advantage without the std, which biases toward
    questions of low reward variance (Liu et al. 2025, "Understanding R1-Zero-Like
    Training", arXiv 2503.20783, section 3.1, eq. 2). rl.batch.normalize_std=True
    is refused."""

    def check(self, config) -> None:
        AdvantageEstimator.check(self, config)
