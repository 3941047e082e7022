"""Task-level RL: which traces train (`data`), traces -> packed batch (`batching`),
collectors (`collectors`), the trainer (`trainer`), and the driver split into collector
and learner processes (`split`)."""

from ac2_jax.training.rl.batching import batch_segments, build_batch, pack_rl_batch
from ac2_jax.training.rl.branches import (
    BranchCounts,
    branch_groups,
    continued_path,
    left_out_responses,
    recorded_choices,
    unchosen_branch_episodes,
)
from ac2_jax.training.rl.collectors import (
    Collector,
    EndpointCollector,
    ReplayCollector,
    attempt_sampling_seed,
    refill_seed,
)
from ac2_jax.training.rl.data import (
    BatchConfig,
    BatchStats,
    agent_trained,
    check_sampled,
    group_name,
    informative_groups,
    select_traces,
    trace_advantages,
    trace_rewards,
    trace_version,
)
from ac2_jax.training.rl.features import (
    ADVANTAGES,
    RL_FEATURES,
    carries_signal,
    rl_segment,
    with_advantage,
)
from ac2_jax.training.rl.metrics import (
    batch_metrics,
    compaction_events,
    memo_results,
    staleness_histogram,
    trace_agent_metrics,
)
from ac2_jax.training.rl.split import (
    StepMarkers,
    StoreCollector,
    run_collector,
    run_learner,
    step_traces,
    tell_endpoint,
    wait_for_endpoint,
    wait_for_learner,
)
from ac2_jax.training.rl.trainer import RLConfig, RLTrainer

__all__ = [
    "ADVANTAGES",
    "BatchConfig",
    "BatchStats",
    "BranchCounts",
    "Collector",
    "EndpointCollector",
    "RLConfig",
    "RLTrainer",
    "RL_FEATURES",
    "ReplayCollector",
    "StepMarkers",
    "StoreCollector",
    "agent_trained",
    "attempt_sampling_seed",
    "batch_metrics",
    "batch_segments",
    "branch_groups",
    "build_batch",
    "carries_signal",
    "check_sampled",
    "compaction_events",
    "continued_path",
    "group_name",
    "informative_groups",
    "left_out_responses",
    "memo_results",
    "pack_rl_batch",
    "recorded_choices",
    "refill_seed",
    "rl_segment",
    "run_collector",
    "run_learner",
    "select_traces",
    "staleness_histogram",
    "step_traces",
    "tell_endpoint",
    "trace_advantages",
    "trace_agent_metrics",
    "trace_rewards",
    "trace_version",
    "unchosen_branch_episodes",
    "wait_for_endpoint",
    "wait_for_learner",
    "with_advantage",
]
