"""Task-level RL: traces -> packed batch (`data`), collectors and the trainer (`trainer`)."""

from ac2_jax.training.rl.data import (BatchConfig, BatchStats, build_batch, check_sampled,
                                      group_name, select_traces, trace_advantages, trace_rewards,
                                      trace_version, unchosen_branch_episodes)
from ac2_jax.training.rl.trainer import (Collector, EndpointCollector, ReplayCollector, RLConfig,
                                         RLTrainer)

__all__ = [
    "BatchConfig", "BatchStats", "Collector", "EndpointCollector", "RLConfig", "RLTrainer",
    "ReplayCollector", "build_batch", "check_sampled", "group_name", "select_traces",
    "trace_advantages", "trace_rewards", "trace_version", "unchosen_branch_episodes",
]
