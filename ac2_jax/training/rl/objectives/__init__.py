"""The RL objectives beside PPO (`training.core.PolicyGradientLoss`, kind "ppo"), one
module each, registered in `OBJECTIVES` and picked with `rl.loss.kind`:

    grpo     GRPO (Shao et al. 2024)            `grpo.GRPOLoss`
    dr_grpo  Dr. GRPO (Liu et al. 2025)         `grpo.DrGRPOLoss`
    dapo     DAPO (Yu et al. 2025)              `dapo.DAPOLoss`
    gspo     GSPO (Zheng et al. 2025)           `gspo.GSPOLoss`
    cispo    CISPO (MiniMax-M1, 2025)           `cispo.CISPOLoss`

Each is a `PolicyGradientLoss` that changes the per-token surrogate or its
defaults, so all of them take the KL to the reference (`kl_coef`), the entropy
bonus (`entropy_coef`), chunking and any aggregation mode. The advantage that
multiplies them is the batch's (`rl.batch.advantage`, `training.rl.advantages`).
docs/howto/choosing-an-objective.md has the table.
"""

from ac2_jax.training.rl.objectives.cispo import CISPOLoss
from ac2_jax.training.rl.objectives.dapo import DAPOLoss
from ac2_jax.training.rl.objectives.grpo import DrGRPOLoss, GRPOLoss
from ac2_jax.training.rl.objectives.gspo import GSPOLoss

__all__ = ["CISPOLoss", "DAPOLoss", "DrGRPOLoss", "GRPOLoss", "GSPOLoss"]
