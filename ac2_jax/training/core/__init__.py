"""What every trainer shares: the loop (`Trainer`), train state, the jitted step, objectives,
sharding, checkpoints, metrics."""

from ac2_jax.training.core.checkpoints import Checkpointer, publish
from ac2_jax.training.core.distributed import process_share as process_share
from ac2_jax.training.core.metrics_log import MetricsLogger as MetricsLogger
from ac2_jax.training.core.metrics_log import read_metrics as read_metrics
from ac2_jax.training.core.objectives import (
    OBJECTIVES,
    LossFn,
    Objective,
    PolicyGradientLoss,
    SFTLoss,
    StepModel,
)
from ac2_jax.training.core.objectives import behaviour_logprobs as behaviour_logprobs
from ac2_jax.training.core.objectives import model_logprobs as model_logprobs
from ac2_jax.training.core.sharding import make_mesh
from ac2_jax.training.core.sharding import state_shardings as state_shardings
from ac2_jax.training.core.state import OptimizerConfig, TrainState, create_train_state
from ac2_jax.training.core.state import abstract_train_state as abstract_train_state
from ac2_jax.training.core.state import num_params as num_params
from ac2_jax.training.core.train_step import StepCache as StepCache
from ac2_jax.training.core.train_step import make_train_step
from ac2_jax.training.core.trainer import Trainer, TrainerHooks

__all__ = [
    "Trainer",
    "TrainerHooks",
    "TrainState",
    "OptimizerConfig",
    "create_train_state",
    "make_train_step",
    "OBJECTIVES",
    "Objective",
    "LossFn",
    "StepModel",
    "PolicyGradientLoss",
    "SFTLoss",
    "Checkpointer",
    "publish",
    "make_mesh",
]
