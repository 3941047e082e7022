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

from ac2_jax.training.core import *  # noqa: F401,F403
from ac2_jax.training.core import __all__ as _core
from ac2_jax.training.distill import *  # noqa: F401,F403
from ac2_jax.training.distill import __all__ as _distill
from ac2_jax.training.rl import *  # noqa: F401,F403
from ac2_jax.training.rl import __all__ as _rl
from ac2_jax.training.sft import *  # noqa: F401,F403
from ac2_jax.training.sft import __all__ as _sft

__all__ = sorted({*_core, *_rl, *_sft, *_distill})
