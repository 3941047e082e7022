"""What every trainer shares: the loop (`Trainer`), train state, the jitted step, objectives,
sharding, checkpoints, metrics."""

from ac2_jax.training.core.checkpoints import Checkpointer, publish
from ac2_jax.training.core.distributed import global_batch, process_share
from ac2_jax.training.core.metrics_log import MetricsLogger, read_metrics
from ac2_jax.training.core.objectives import (
    OBJECTIVES,
    LossFn,
    Objective,
    PolicyGradientLoss,
    SFTLoss,
    StepModel,
    apply_loss,
    behaviour_logprobs,
    constraint_args,
    lm_head_of,
    model_logprobs,
)
from ac2_jax.training.core.sharding import (
    AXES,
    make_mesh,
    replicate,
    shard_batch,
    shard_state,
    state_shardings,
    unreplicate,
)
from ac2_jax.training.core.state import (
    OptimizerConfig,
    TrainState,
    abstract_train_state,
    create_train_state,
    num_params,
)
from ac2_jax.training.core.train_step import StepCache, TrainStep, make_train_step
from ac2_jax.training.core.trainer import Trainer, TrainerHooks

__all__ = [
    "AXES",
    "Checkpointer",
    "LossFn",
    "MetricsLogger",
    "OBJECTIVES",
    "Objective",
    "OptimizerConfig",
    "PolicyGradientLoss",
    "SFTLoss",
    "StepCache",
    "StepModel",
    "TrainState",
    "TrainStep",
    "Trainer",
    "TrainerHooks",
    "abstract_train_state",
    "apply_loss",
    "behaviour_logprobs",
    "constraint_args",
    "create_train_state",
    "global_batch",
    "lm_head_of",
    "make_mesh",
    "make_train_step",
    "model_logprobs",
    "num_params",
    "process_share",
    "publish",
    "read_metrics",
    "replicate",
    "shard_batch",
    "shard_state",
    "state_shardings",
    "unreplicate",
]
