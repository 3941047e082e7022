"""RLOO: each attempt's baseline is the mean of the group's other attempts."""

from __future__ import annotations

import dataclasses

import numpy as np

from ac2_jax.training.rl.advantages.base import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    group_members,
    spread,
)


@ADVANTAGE_ESTIMATORS.register("rloo")
@dataclasses.dataclass(frozen=True)
class RLOOAdvantage(AdvantageEstimator):
    """A_i = R_i - 1/(k-1) sum_{j != i} R_j  (= k/(k-1) (R_i - mean_g R)) for the k
    attempts of a group: REINFORCE Leave-One-Out, Kool et al. 2019 ("Buy 4
    REINFORCE samples, get a baseline for free!"), as Ahmadian et al. 2024 ("Back
    to Basics", arXiv 2402.14740) eq. 7 use it for LLMs. Unbiased: the baseline
    of attempt i does not depend on its own sample. A lone attempt (k = 1) or a
    tied group: exactly 0. No std normalisation (normalize_std refused).
    """

    def __call__(self, rewards, groups, *, normalize_std=False, std_ddof=0, eps=1e-6):
        adv = np.zeros(len(rewards), np.float64)
        for idx in group_members(groups).values():
            r = rewards[idx]
            if not spread(r):
                continue
            k = len(r)
            adv[idx] = r - (r.sum() - r) / (k - 1)
        return adv
