"""Task-level RL: traces -> packed batch (`data`), collectors (`collectors`), the trainer (`trainer`)."""

from ac2_jax.training.rl.data import (BatchConfig, BatchStats, agent_trained, build_batch,
                                      check_sampled, group_name, informative_groups, select_traces,
                                      trace_advantages, trace_rewards, trace_version,
                                      unchosen_branch_episodes)
from ac2_jax.training.rl.collectors import (Collector, EndpointCollector, ReplayCollector,
                                            refill_seed)
from ac2_jax.training.rl.metrics import (agent_group, batch_metrics, compaction_events,
                                         memo_results, staleness_histogram, trace_agent_metrics)
from ac2_jax.training.rl.trainer import RLConfig, RLTrainer

__all__ = [
    "BatchConfig", "BatchStats", "Collector", "EndpointCollector", "RLConfig", "RLTrainer",
    "ReplayCollector", "agent_group", "agent_trained", "batch_metrics", "build_batch",
    "check_sampled", "compaction_events", "group_name", "informative_groups", "memo_results",
    "refill_seed", "select_traces", "staleness_histogram", "trace_advantages",
    "trace_agent_metrics", "trace_rewards", "trace_version", "unchosen_branch_episodes",
]
