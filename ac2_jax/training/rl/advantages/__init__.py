"""Advantage estimators (`rl.batch.advantage.kind`), one module each, registered in
`ADVANTAGE_ESTIMATORS`:

    grpo          R - mean_g (/ std_g with normalize_std)   (default; today's)
    dr_grpo       R - mean_g, no std
    rloo          R - mean of the group's other attempts
    reinforce     R - b (constant baseline, default 0)
    reinforce_pp  (R - mean_B) / std_B over the batch; group_baseline=True:
                  (R - mean_g) / std_B  (REINFORCE++-baseline)

Each maps the kept attempts' rewards (float64, host-side) to one advantage per
attempt; docs/howto/choosing-an-objective.md has the table.
"""

from ac2_jax.training.rl.advantages.base import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    group_members,
)
from ac2_jax.training.rl.advantages.grpo import DrGRPOAdvantage, GRPOAdvantage
from ac2_jax.training.rl.advantages.reinforce import ReinforceAdvantage, ReinforcePPAdvantage
from ac2_jax.training.rl.advantages.rloo import RLOOAdvantage

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "DrGRPOAdvantage",
    "GRPOAdvantage",
    "RLOOAdvantage",
    "ReinforceAdvantage",
    "ReinforcePPAdvantage",
    "group_members",
]
