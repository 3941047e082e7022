"""Traces -> an RL batch: failures, staleness, group advantages, packing.

Pure host-side functions, shared by the sync and async loops so both build
identical batches from identical traces.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ac2_jax.losses import group_advantages
from ac2_jax.segments import PackedBatch, pack_segments, segments_from_trace
from ac2_jax.trace.types import Trace

FAILED_POLICIES = ("zero", "drop")
STALE_POLICIES = ("drop", "downweight")


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    """How traces become a batch. `rows` is the minimum row count (static shapes)."""

    seq_len: int = 256
    rows: int = 16
    rows_multiple: int = 1
    segment_mode: str = "episode"
    layout: str = "flat"
    normalize_std: bool = False
    failed: str = "zero"            # failed/timed-out rollouts: reward 0, or dropped
    max_staleness: int = 1          # policy versions a trace may lag the learner
    stale: str = "drop"             # older traces: dropped, or down-weighted
    stale_weight: float = 0.5

    def __post_init__(self):
        if self.failed not in FAILED_POLICIES:
            raise ValueError(f"BatchConfig.failed must be one of {FAILED_POLICIES}, got {self.failed!r}")
        if self.stale not in STALE_POLICIES:
            raise ValueError(f"BatchConfig.stale must be one of {STALE_POLICIES}, got {self.stale!r}")


def trace_version(trace: Trace) -> int:
    """Oldest policy version that sampled any token of the trace."""
    versions = [c.policy_version for e in trace.episodes for c in e.completions]
    return min(versions) if versions else 0


@dataclasses.dataclass
class BatchStats:
    traces: int = 0
    failed: int = 0
    dropped_failed: int = 0
    dropped_stale: int = 0
    downweighted: int = 0
    empty: int = 0
    staleness_mean: float = 0.0
    staleness_max: int = 0


def select_traces(traces: Sequence[Trace], learner_version: int, config: BatchConfig
                  ) -> tuple[list[Trace], list[float], BatchStats]:
    """Applies the failure and staleness rules. Returns (kept, weights, stats)."""
    stats = BatchStats(traces=len(traces))
    kept, weights, lags = [], [], []
    for t in traces:
        if t.status != "finished" or t.reward is None:
            stats.failed += 1
            if config.failed == "drop":
                stats.dropped_failed += 1
                continue
        lag = max(0, learner_version - trace_version(t))
        lags.append(lag)
        w = 1.0
        if lag > config.max_staleness:
            if config.stale == "drop":
                stats.dropped_stale += 1
                continue
            w = config.stale_weight ** (lag - config.max_staleness)
            stats.downweighted += 1
        if not t.num_agent_tokens:
            stats.empty += 1
        kept.append(t)
        weights.append(w)
    if lags:
        stats.staleness_mean, stats.staleness_max = float(np.mean(lags)), int(max(lags))
    return kept, weights, stats


def trace_rewards(traces: Sequence[Trace]) -> np.ndarray:
    """Rewards, with failed / missing ones as 0."""
    return np.array([float(t.reward) if (t.status == "finished" and t.reward is not None)
                     else 0.0 for t in traces], np.float32)


def trace_advantages(traces: Sequence[Trace], normalize_std: bool = False) -> np.ndarray:
    """Group-relative advantages; a trace's group is its group_id (else its task)."""
    names = [t.group_id or t.task_id for t in traces]
    index = {n: i for i, n in enumerate(dict.fromkeys(names))}
    groups = np.array([index[n] for n in names], np.int32)
    return np.asarray(group_advantages(trace_rewards(traces), groups, normalize_std))


def build_batch(traces: Sequence[Trace], learner_version: int, config: BatchConfig
                ) -> tuple[PackedBatch | None, BatchStats, np.ndarray]:
    """Traces -> (packed batch or None when nothing trainable, stats, advantages).

    Advantages come from every selected trace's group; each trace's one
    advantage goes to all of its segments (the whole trace is one unit).
    """
    kept, weights, stats = select_traces(traces, learner_version, config)
    if not kept:
        return None, stats, np.zeros(0, np.float32)
    adv = trace_advantages(kept, config.normalize_std)
    segments = []
    for t, a, w in zip(kept, adv, weights):
        for s in segments_from_trace(t, mode=config.segment_mode, advantage=float(a)):
            if s.num_agent_tokens:
                s.weight = w
                segments.append(s)
    if not segments:
        return None, stats, adv
    batch = pack_segments(segments, config.seq_len, truncate=True, min_rows=config.rows,
                          rows_multiple=max(config.rows_multiple, 1), layout=config.layout)
    return batch, stats, adv
