"""Per-attempt eval records and their summaries (pure functions over records).

An attempt is scored unless it ended `infra_error` (our fault) under the
"exclude" policy: it is then left out of every rate and mean and counted
(`excluded_infra_errors`; all statuses are counted in `failures`). A scored
attempt without a reward (timed_out, or an agent_error the verifier gave
none) scores 0. Pass: score >= the pass threshold.

Intervals: with one scored attempt per task, pass rate is Wilson over
attempts and means are t over attempts; with several, both are clustered by
task (`clustered_interval`: mean of per-task means, t over tasks). Process
metrics are means per scored attempt (intervals clipped at 0); token totals and cost cover every
kept attempt (a retried infra_error's discarded runs are only counted, in
`infra_retries`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from ac2_jax.evals.cost import (
    PrefixStats,
    TokenCost,
    TokenPrices,
    prefix_stats,
    token_cost,
    trace_tokens,
)
from ac2_jax.evals.passk import (
    pass_at_k,
    pass_at_k_interval,
    pass_hat_k,
    pass_hat_k_interval,
    pass_k_values,
)
from ac2_jax.evals.stats import Estimate, clustered_interval, mean_interval, wilson_interval
from ac2_jax.trace.types import Trace

PROCESS_METRICS = (
    "steps",
    "tool_calls",
    "tool_errors",
    "prompt_tokens",
    "cached_tokens",
    "uncached_tokens",
    "output_tokens",
    "wall_time_s",
    "episodes",
    "requests",
)
TOKEN_KEYS = ("requests", "prompt_tokens", "cached_tokens", "uncached_tokens", "output_tokens")
STATUSES = ("finished", "agent_error", "timed_out", "infra_error")
INFRA_POLICIES = ("exclude", "fail")


@dataclasses.dataclass
class AttemptRecord:
    """One attempt at one task: outcome, process metrics, prefix reuse."""

    task_id: str
    domain: str
    attempt: int
    seed: int | None
    status: str
    reward: float | None  # the verifier's (None: none given)
    scored: bool  # counted in rates and means
    passed: bool
    metrics: dict[str, float]  # PROCESS_METRICS
    prefix: PrefixStats
    error: str | None = None
    infra_retries: int = 0  # runs of this attempt discarded as infra_error

    @property
    def score(self) -> float:
        return float(self.reward) if self.reward is not None else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["prefix"] = self.prefix.to_dict()
        return d


def attempt_record(
    trace: Trace,
    *,
    domain: str,
    attempt: int,
    seed: int | None,
    pass_threshold: float = 1.0,
    infra_error: str = "exclude",
    infra_retries: int = 0,
) -> AttemptRecord:
    """The record of a finished attempt's trace (its metrics as `run_rollout`
    left them: the orchestrator's steps, tool calls, wall time; tokens from
    the trace's completions)."""
    if infra_error not in INFRA_POLICIES:
        raise ValueError(f"infra_error must be one of {INFRA_POLICIES}, got {infra_error!r}")
    tokens = trace_tokens(trace)
    m = trace.metrics
    metrics = {
        "steps": float(m.get("steps", 0)),
        "tool_calls": float(m.get("tool_calls", 0)),
        "tool_errors": float(m.get("tool_errors", 0)),
        "wall_time_s": float(m.get("wall_time_s", 0.0)),
        "episodes": float(len(trace.episodes)),
        **{key: float(tokens[key]) for key in TOKEN_KEYS},
    }
    scored = not (trace.status == "infra_error" and infra_error == "exclude")
    reward = None if trace.reward is None else float(trace.reward)
    passed = scored and reward is not None and reward >= pass_threshold
    error = (trace.metadata.get("artifacts") or {}).get("error")
    return AttemptRecord(
        trace.task_id,
        domain,
        int(attempt),
        seed,
        trace.status,
        reward,
        scored,
        passed,
        metrics,
        prefix_stats(trace),
        error,
        int(infra_retries),
    )


def _by_task(records: Sequence[AttemptRecord]) -> dict[str, list[AttemptRecord]]:
    out: dict[str, list[AttemptRecord]] = {}
    for r in records:
        out.setdefault(r.task_id, []).append(r)
    return out


def _mean(groups: list[list[float]], level: float, bounds=None) -> Estimate | None:
    """t over values (one per group) or clustered-t (several per group)."""
    groups = [g for g in groups if g]
    if not groups:
        return None
    if all(len(g) == 1 for g in groups):
        e = mean_interval([g[0] for g in groups], level)
        if bounds is not None:
            e = dataclasses.replace(e, low=max(bounds[0], e.low), high=min(bounds[1], e.high))
        return e
    return clustered_interval(groups, level, bounds=bounds)


def _failures(records: Sequence[AttemptRecord]) -> dict[str, int]:
    counts = collections.Counter(r.status for r in records)
    return {
        **{s: counts.get(s, 0) for s in STATUSES},
        **{s: n for s, n in counts.items() if s not in STATUSES},
    }


def _tokens(records: Sequence[AttemptRecord]) -> dict[str, int]:
    return {k: int(sum(r.metrics[k] for r in records)) for k in TOKEN_KEYS}


def _cost(records: Sequence[AttemptRecord], prices: TokenPrices) -> TokenCost:
    t = _tokens(records)
    return token_cost(t["cached_tokens"], t["uncached_tokens"], t["output_tokens"], prices)


def _pass_k(counts: list[tuple[int, int]], max_k: int, level: float, fn: Callable):
    out, short = {}, {}
    for k in pass_k_values(max_k):
        ok = [(n, c) for n, c in counts if n >= k]
        short[str(k)] = len(counts) - len(ok)
        out[str(k)] = fn(ok, k, level) if ok else None
    return out, short


def group_summary(
    records: Sequence[AttemptRecord],
    *,
    level: float = 0.95,
    prices: TokenPrices | None = None,
    max_k: int | None = None,
) -> dict[str, Any]:
    """Summary of a set of attempts (a run, a domain): counts, pass rate, mean
    reward, pass@k and pass^k (k in `pass_k_values(max_k)`; tasks with fewer
    scored attempts than k are left out and counted in tasks_short_of_k),
    process metrics, token totals, prefix reuse, cost. Values are Estimates
    (None where nothing was scored)."""
    tasks = _by_task(records)
    scored = {t: [r for r in rs if r.scored] for t, rs in tasks.items()}
    max_k = max_k or max(len(rs) for rs in tasks.values())
    counts = [(len(rs), sum(r.passed for r in rs)) for rs in scored.values() if rs]
    pass_rate: Estimate | None
    if counts and all(n == 1 for n, _ in counts):
        pass_rate = wilson_interval(sum(c for _, c in counts), len(counts), level)
    else:
        pass_rate = _mean(
            [[float(r.passed) for r in rs] for rs in scored.values()], level, bounds=(0.0, 1.0)
        )
    pass_at, short = _pass_k(counts, max_k, level, pass_at_k_interval)
    pass_hat, _ = _pass_k(counts, max_k, level, pass_hat_k_interval)
    prefix = sum((r.prefix for r in records), PrefixStats())
    return {
        "tasks": len(tasks),
        "tasks_scored": len(counts),
        "attempts": len(records),
        "scored_attempts": sum(n for n, _ in counts),
        "excluded_infra_errors": sum(not r.scored for r in records),
        "infra_retries": sum(r.infra_retries for r in records),
        "failures": _failures(records),
        "pass_rate": pass_rate,
        "mean_reward": _mean([[r.score for r in rs] for rs in scored.values()], level),
        "pass_at_k": pass_at,
        "pass_hat_k": pass_hat,
        "tasks_short_of_k": short,
        "process": {
            m: _mean(
                [[r.metrics[m] for r in rs] for rs in scored.values()],
                level,
                bounds=(0.0, math.inf),
            )  # counts and times: never below 0
            for m in PROCESS_METRICS
        },
        "tokens": _tokens(records),
        "prefix": prefix,
        "cost": _cost(records, prices) if prices is not None else None,
    }


def task_summary(
    records: Sequence[AttemptRecord], *, prices: TokenPrices | None = None
) -> dict[str, Any]:
    """One task's attempts: counts, pass fraction, mean reward, per-task pass@k
    and pass^k (k up to its scored attempts), tokens, cost."""
    scored = [r for r in records if r.scored]
    n, c = len(scored), sum(r.passed for r in scored)
    ks = pass_k_values(len(records))
    return {
        "domain": records[0].domain,
        "attempts": len(records),
        "scored_attempts": n,
        "passes": c,
        "pass_fraction": c / n if n else None,
        "mean_reward": sum(r.score for r in scored) / n if n else None,
        "failures": _failures(records),
        "pass_at_k": {str(k): pass_at_k(n, c, k) for k in ks if k <= n},
        "pass_hat_k": {str(k): pass_hat_k(n, c, k) for k in ks if k <= n},
        "tokens": _tokens(records),
        "cost": _cost(records, prices) if prices is not None else None,
    }


def summarize(
    records: Sequence[AttemptRecord], *, level: float = 0.95, prices: TokenPrices | None = None
) -> dict[str, Any]:
    """{"overall", "per_domain": {domain: ...}, "per_task": {task_id: ...}} (tasks
    in first-seen order); `jsonable` turns it into plain JSON."""
    if not records:
        raise ValueError("summarize: no attempts")
    max_k = max(len(rs) for rs in _by_task(records).values())
    domains: dict[str, list[AttemptRecord]] = {}
    for r in records:
        domains.setdefault(r.domain, []).append(r)
    return {
        "overall": group_summary(records, level=level, prices=prices, max_k=max_k),
        "per_domain": {
            d: group_summary(rs, level=level, prices=prices, max_k=max_k)
            for d, rs in domains.items()
        },
        "per_task": {t: task_summary(rs, prices=prices) for t, rs in _by_task(records).items()},
    }


def jsonable(obj: Any) -> Any:
    """Estimates, costs and prefix stats inside dicts/lists -> their to_dict()."""
    if isinstance(obj, (Estimate, TokenCost, PrefixStats, AttemptRecord)):
        return obj.to_dict()
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj
