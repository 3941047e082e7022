"""What every trainer shares: the loop (`Trainer`), train state, the jitted step, objectives,
sharding, checkpoints, metrics."""

from ac2_jax.training.core.checkpoints import Checkpointer, publish
from ac2_jax.training.core.distributed import global_batch, process_share
from ac2_jax.training.core.metrics_log import MetricsLogger, read_metrics
from ac2_jax.training.core.objectives import (LossFn, PolicyGradientLoss, SFTLoss,
                                              behaviour_logprobs)
from ac2_jax.training.core.sharding import (AXES, make_mesh, replicate, shard_batch, shard_state,
                                            state_shardings, unreplicate)
from ac2_jax.training.core.state import (OptimizerConfig, TrainState, abstract_train_state,
                                         create_train_state, num_params)
from ac2_jax.training.core.train_step import StepCache, TrainStep, make_train_step
from ac2_jax.training.core.trainer import Trainer, TrainerHooks

__all__ = [
    "AXES", "Checkpointer", "LossFn", "MetricsLogger", "OptimizerConfig", "PolicyGradientLoss",
    "SFTLoss", "StepCache", "TrainState", "TrainStep", "Trainer", "TrainerHooks",
    "abstract_train_state", "behaviour_logprobs", "create_train_state", "global_batch", "make_mesh", "make_train_step", "num_params", "process_share", "publish",
    "read_metrics", "replicate", "shard_batch", "shard_state", "state_shardings", "unreplicate",
]
