"""Training: one loop, step and state (`core`), and what each driver adds (`rl`, `sft`,
`distill`).

    graphdef, state = create_train_state(model, OptimizerConfig(...))
    trainer = Trainer(graphdef, state, SFTLoss(), opt, mesh=make_mesh(4, 2),
                      workdir="run", checkpoint_every=100)
    start = trainer.restore()
    metrics = trainer.step(packed_batch)   # logged as train/..., checkpointed on the cadence

`RLTrainer`, `run_sft` and `SelfDistiller` are built on `Trainer`: all three
resume exactly from Orbax checkpoints and log the same way.
"""

# The entry points of the three drivers and what they share; everything else is
# imported from its subpackage (`ac2_jax.training.core`, `.rl`, `.sft`, `.distill`),
# whose own `__all__` is the full surface.
from ac2_jax.training.core import OBJECTIVES as OBJECTIVES
from ac2_jax.training.core import Checkpointer as Checkpointer
from ac2_jax.training.core import (
    OptimizerConfig,
    PolicyGradientLoss,
    Trainer,
    create_train_state,
    make_mesh,
    make_train_step,
    publish,
)
from ac2_jax.training.core import SFTLoss as SFTLoss
from ac2_jax.training.core import TrainerHooks as TrainerHooks
from ac2_jax.training.distill import DistillConfig, SelfDistiller
from ac2_jax.training.rl import BatchConfig, RLConfig, RLTrainer
from ac2_jax.training.sft import SFTConfig, run_sft

__all__ = [
    "BatchConfig",
    "DistillConfig",
    "OptimizerConfig",
    "PolicyGradientLoss",
    "RLConfig",
    "RLTrainer",
    "SFTConfig",
    "SelfDistiller",
    "Trainer",
    "create_train_state",
    "make_mesh",
    "make_train_step",
    "publish",
    "run_sft",
]
