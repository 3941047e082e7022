"""Training: train state, steps under jit / mesh / pmap, losses, SFT, checkpoints.

    graphdef, state = create_train_state(model, OptimizerConfig(...))
    step = make_train_step(graphdef, SFTLoss(), opt, mode="jit", mesh=make_mesh(4, 2))
    state = step.place(state)
    state, metrics = step(state, packed_batch)
"""

from ac2_jax.training.checkpoints import Checkpointer, publish
from ac2_jax.training.distill import DistillConfig, DistillLoss, SelfDistiller
from ac2_jax.training.distill_data import (DistillExample, HintConfig, PairedBatch,
                                          examples_from_traces, insert_hint, pack_pairs)
from ac2_jax.training.objectives import LossFn, PolicyGradientLoss, SFTLoss, loss_weights
from ac2_jax.training.sft import SFTConfig, SFTData, SFTResult, run_sft
from ac2_jax.training.sharding import (AXES, make_mesh, replicate, shard_batch, shard_state,
                                       state_shardings, unreplicate)
from ac2_jax.training.state import (OptimizerConfig, TrainState, abstract_train_state,
                                    create_train_state, num_params)
from ac2_jax.training.train_step import TrainStep, make_train_step

__all__ = [
    "AXES", "Checkpointer", "LossFn", "OptimizerConfig", "PolicyGradientLoss", "SFTConfig",
    "SFTData", "SFTLoss", "SFTResult", "TrainState", "TrainStep", "abstract_train_state",
    "create_train_state",
    "loss_weights", "make_mesh", "make_train_step", "num_params", "publish", "replicate",
    "run_sft", "shard_batch", "shard_state", "state_shardings", "unreplicate",
    "DistillConfig", "DistillExample", "DistillLoss", "HintConfig", "PairedBatch",
    "SelfDistiller", "examples_from_traces", "insert_hint", "pack_pairs",
]
