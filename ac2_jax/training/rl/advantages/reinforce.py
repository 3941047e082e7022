"""REINFORCE (no baseline) and REINFORCE++ (global batch normalisation)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ac2_jax.training.rl.advantages.base import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    group_members,
    spread,
)


@ADVANTAGE_ESTIMATORS.register("reinforce")
@dataclasses.dataclass(frozen=True)
class ReinforceAdvantage(AdvantageEstimator):
    """A_i = R_i - b with a constant baseline b (default 0): Williams 1992, "Simple
    statistical gradient-following algorithms" (REINFORCE, eq. 11 with a
    reinforcement baseline b independent of the action). No group baseline, so
    a group of equal non-zero rewards still pushes (its advantages are not 0)
    and is no "zero-advantage group". normalize_std refused."""

    baseline: float = 0.0

    def __call__(self, rewards, groups, *, normalize_std=False, std_ddof=0, eps=1e-6):
        return np.asarray(rewards, np.float64) - self.baseline


@ADVANTAGE_ESTIMATORS.register("reinforce_pp")
@dataclasses.dataclass(frozen=True)
class ReinforcePPAdvantage(AdvantageEstimator):
    """REINFORCE++, Hu et al. 2025 (arXiv 2501.03262), eq. 8-9 with no KL in the
    reward: A_i = (R_i - mean_B R) / (std_B R + eps) over the whole batch B of
    kept attempts (not per group). group_baseline=True is the paper's
    "REINFORCE++-baseline": A'_i = R_i - mean_g(R) per group (exactly 0 for tied
    groups and lone attempts), then A_i = A'_i / (std_B(A') + eps) (the batch
    mean of A' is 0 by construction, so only the std is taken; tied groups stay
    exactly 0). Population std. The normalisation is per attempt, where
    OpenRLHF whitens per token (longer attempts weigh more there). A batch whose
    rewards are all equal gets 0. normalize_std refused (it normalises itself).
    """

    group_baseline: bool = False

    def __call__(self, rewards, groups, *, normalize_std=False, std_ddof=0, eps=1e-6):
        r = np.asarray(rewards, np.float64)
        if not self.group_baseline:
            if not spread(r):
                return np.zeros(len(r), np.float64)
            return (r - r.mean()) / (r.std() + eps)
        adv = np.zeros(len(r), np.float64)
        for idx in group_members(groups).values():
            if spread(r[idx]):
                adv[idx] = r[idx] - r[idx].mean()
        if not np.any(adv):
            return adv
        return adv / (adv.std() + eps)
