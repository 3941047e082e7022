"""Training: one step and state (`core`), and what each trainer adds (`rl`, `sft`, `distill`).

    graphdef, state = create_train_state(model, OptimizerConfig(...))
    step = make_train_step(graphdef, SFTLoss(), opt, mode="jit", mesh=make_mesh(4, 2))
    state = step.place(state)
    state, metrics = step(state, packed_batch)
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
