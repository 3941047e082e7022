"""Per-agent figures of an RL step or an eval run, as flat float dicts.

The design's claim is that one task reward trains every episode of an
attempt (main agent, compactor, subagents); these figures show what each
agent contributed: tokens generated and trained per agent label, episodes per
attempt, compactions per attempt, memo fidelity, and how stale the traces
were. Pure functions over traces (and `BatchStats`); keys follow the metrics
log's convention for families, `name/<sub>` (as the mixer's
`mix_weight/<domain>`), so `MetricsLogger` writes them as `train/name/<sub>`
and TensorBoard groups them. A histogram is one key per bin
(`staleness_hist/<lag>`), every bin from 0 to the largest present.

Agent labels are grouped as the loss selects them: `subagent:<name>` counts
as `subagent`; any other label (`main`, `compactor`) is its own group.
Compaction events come from `Trace.events` (kind "compaction"); memo fidelity
is the mean of their `memo_ok` over the events that carry it (an env that
can judge a memo sets it: whether the memo holds the value the next step
needs), absent when no event carries it.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

from ac2_jax.trace.agents import agent_group
from ac2_jax.trace.types import Trace
from ac2_jax.training.rl.data import BatchStats, trained_version


def compaction_events(trace: Trace) -> list[dict[str, Any]]:
    """The trace's compaction events (`Trace.events` of kind "compaction"), in order."""
    return [e for e in trace.events if e.get("kind") == "compaction"]


def memo_results(traces: Sequence[Trace]) -> list[list[bool]]:
    """Per trace, the `memo_ok` verdicts of its compaction events that carry one
    (e.g. for a CI clustered by attempt)."""
    return [
        [bool(e["memo_ok"]) for e in compaction_events(t) if e.get("memo_ok") is not None]
        for t in traces
    ]


def trace_agent_metrics(traces: Sequence[Trace]) -> dict[str, float]:
    """Per-agent figures of a list of traces (an RL step's, or an eval run's).

    Returns (floats): attempts; episodes_per_trace; agent_tokens (all agent
    tokens generated) and agent_tokens/<group>; episodes/<group> (mean per
    attempt); compactions_per_attempt; memos_judged (compaction events with a
    memo_ok) and, when > 0, memo_fidelity (their share with memo_ok true).
    Means over no traces are 0.
    """
    n = len(traces)
    tokens: dict[str, int] = collections.Counter()
    episodes: dict[str, int] = collections.Counter()
    for t in traces:
        for e in t.episodes:
            tokens[agent_group(e.agent)] += e.num_agent_tokens
            episodes[agent_group(e.agent)] += 1
    verdicts = [ok for per_trace in memo_results(traces) for ok in per_trace]
    out = {
        "attempts": float(n),
        "episodes_per_trace": sum(episodes.values()) / n if n else 0.0,
        "agent_tokens": float(sum(tokens.values())),
        **{f"agent_tokens/{g}": float(v) for g, v in sorted(tokens.items())},
        **{f"episodes/{g}": v / n for g, v in sorted(episodes.items())},
        "compactions_per_attempt": (
            sum(len(compaction_events(t)) for t in traces) / n if n else 0.0
        ),
        "memos_judged": float(len(verdicts)),
    }
    if verdicts:
        out["memo_fidelity"] = sum(verdicts) / len(verdicts)
    return out


def staleness_histogram(
    traces: Sequence[Trace], learner_version: int, train_agents: tuple[str, ...] | None = None
) -> dict[str, float]:
    """staleness_hist/<lag>: how many of the traces lag the learner by `lag` policy
    versions (lag = learner_version - the oldest version that sampled a token that
    trains, `data.trained_version`: the continued path, the agents `train_agents`
    trains; floored at 0), one key per lag from 0 to the largest seen. Traces
    with no completion that trains (e.g. infra errors before any request) have no
    version and are not in it (`BatchStats.no_completions` counts the kept ones
    that never called the model)."""
    versions = (trained_version(t, train_agents) for t in traces)
    lags = collections.Counter(max(0, learner_version - v) for v in versions if v is not None)
    return {
        f"staleness_hist/{lag}": float(lags.get(lag, 0))
        for lag in range(max(lags) + 1 if lags else 0)
    }


def batch_metrics(stats: BatchStats) -> dict[str, float]:
    """`BatchStats` as flat floats: its counters by name, the agent tokens in the
    batch per group as trained_tokens/<group> (0 for a group left out by
    `BatchConfig.train_agents`), and the trained tokens per version lag as
    staleness_tokens/<lag> (per token: a generation that spans in-flight weight
    updates has several lags), every lag from 0 to the largest seen."""
    dicts = ("trained_tokens", "token_lags")
    out = {k: float(v) for k, v in dataclasses.asdict(stats).items() if k not in dicts}
    trained: dict[str, int] = collections.Counter()
    for label, n in stats.trained_tokens.items():
        trained[agent_group(label)] += n
    out.update({f"trained_tokens/{g}": float(v) for g, v in sorted(trained.items())})
    lags = stats.token_lags
    out.update(
        {
            f"staleness_tokens/{lag}": float(lags.get(lag, 0))
            for lag in range(max(lags) + 1 if lags else 0)
        }
    )
    return out
