"""Repeated-run evals over an endpoint: K attempts per task, kept per attempt,
summarised per task, per domain and overall (`ac2_jax.evals.summary`), and
paired comparisons of two runs on the same tasks and seeds."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ac2_jax.envs.base import Env, Task
from ac2_jax.evals.cost import TokenPrices
from ac2_jax.evals.stats import Estimate, paired_difference
from ac2_jax.evals.summary import (
    INFRA_POLICIES,
    AttemptRecord,
    attempt_record,
    jsonable,
    summarize,
)
from ac2_jax.orchestration.rollouts import LifecycleClient, OrchestratorFactory, run_rollout
from ac2_jax.seeds import eval_attempt_seed
from ac2_jax.trace.types import Trace


@dataclasses.dataclass
class EvalResult:
    """Every attempt of an eval run (tasks in `task_ids` order, attempts 0..k-1
    of each) and its summaries. `traces[i]` is `attempts[i]`'s trace (not in
    `to_dict`)."""

    name: str
    task_ids: list[str]
    k: int
    attempts: list[AttemptRecord]
    level: float = 0.95
    prices: TokenPrices | None = None
    traces: list[Trace] = dataclasses.field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        """`summarize` of the attempts (Estimates; `to_dict` has it as JSON)."""
        return summarize(self.attempts, level=self.level, prices=self.prices)

    def per_task(self, metric: str = "pass") -> dict[str, float | None]:
        """Per task: mean over its scored attempts of "pass" (0/1) or "reward"
        (None for a task with no scored attempt)."""
        if metric not in ("pass", "reward"):
            raise ValueError(f"metric must be 'pass' or 'reward', got {metric!r}")
        out: dict[str, list[float]] = {t: [] for t in self.task_ids}
        for r in self.attempts:
            if r.scored:
                out[r.task_id].append(float(r.passed) if metric == "pass" else r.score)
        return {t: (float(np.mean(v)) if v else None) for t, v in out.items()}

    @property
    def rewards(self) -> list[float]:
        """Mean reward per task, in task order. ValueError if a task has no
        scored attempt (all infra_error): use `compare_results`, which drops and
        counts such tasks."""
        per = self.per_task("reward")
        missing = [t for t, v in per.items() if v is None]
        if missing:
            raise ValueError(
                f"EvalResult {self.name}: tasks {missing[:5]} have no scored "
                f"attempt (infra_error); compare_results drops and counts them"
            )
        return [v for t in self.task_ids if (v := per[t]) is not None]  # none is None (above)

    @property
    def pass_rate(self) -> Estimate:
        e = self.summary()["overall"]["pass_rate"]
        if e is None:
            raise ValueError(f"EvalResult {self.name}: no scored attempt (all infra_error)")
        return e

    @property
    def metrics(self) -> dict[str, float | None]:
        """Mean per scored attempt of each process metric."""
        process = self.summary()["overall"]["process"]
        return {m: (e.mean if e is not None else None) for m, e in process.items()}

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: headline numbers, the summary and every attempt."""
        s = self.summary()
        p = s["overall"]["pass_rate"]
        d = {
            "name": self.name,
            "n": len(self.task_ids),
            "k": self.k,
            "level": self.level,
            "pass_rate": p.mean if p else None,
            "metrics": self.metrics,
            "prices": dataclasses.asdict(self.prices) if self.prices else None,
            "summary": jsonable(s),
            "attempts": [a.to_dict() for a in self.attempts],
        }
        if self.level == 0.95:  # the key callers of the one-attempt runner read
            d["pass_rate_ci95"] = [p.low, p.high] if p else None
        return d


async def evaluate(
    lifecycle: LifecycleClient,
    env: Env,
    tasks: Sequence[Task],
    make_orchestrator: OrchestratorFactory,
    model: str,
    *,
    name: str = "eval",
    k: int = 1,
    concurrency: int = 32,
    seed: int | None = 0,
    level: float = 0.95,
    prices: TokenPrices | None = None,
    pass_threshold: float = 1.0,
    infra_error: str = "exclude",
    infra_retries: int = 2,
    timeout_s: float | None = None,
    on_attempt: Callable[[AttemptRecord], None] | None = None,
) -> EvalResult:
    """Runs every task `k` times through the endpoint.

    Attempt a of task i samples with seed `ac2_jax.seeds.eval_attempt_seed(seed, i, a, k)` (set in
    the orchestrator's `sampling`, overriding the factory's; seed=None leaves
    the factory's; the orchestrator gives each request of the attempt its own
    seed derived from it, `ac2_jax.seeds.request_seed`) and group id
    "{name}:{task_id}:{a}", so two runs with the same tasks and seed pair
    attempt by attempt. An attempt that ends infra_error is run again up to
    `infra_retries` times; if it still fails,
    `infra_error` says whether it is left out of the scores ("exclude", counted)
    or scored 0 ("fail"). `on_attempt` is called with each finished record
    (e.g. a progress bar).
    """
    if k < 1:
        raise ValueError(f"evaluate: k (attempts per task) must be >= 1, got {k}")
    if infra_error not in INFRA_POLICIES:
        raise ValueError(
            f"evaluate: infra_error must be one of {INFRA_POLICIES}, got {infra_error!r}"
        )
    if infra_retries < 0:
        raise ValueError(f"evaluate: infra_retries must be >= 0, got {infra_retries}")
    ids = [t.task_id for t in tasks]
    dup = sorted({t for t in ids if ids.count(t) > 1})
    if dup:
        raise ValueError(
            f"evaluate: task ids must be unique; repeated: {dup[:5]} (use k for several attempts)"
        )
    if not tasks:
        raise ValueError("evaluate: no tasks")
    sem = asyncio.Semaphore(concurrency)

    def seeded(s: int | None) -> OrchestratorFactory:
        def make(env_, task, client, model_name):
            orch = make_orchestrator(env_, task, client, model_name)
            if s is not None:
                if not isinstance(getattr(orch, "sampling", None), dict):
                    raise TypeError(
                        f"evaluate: {type(orch).__name__} has no `sampling` dict to "
                        "set the attempt's seed in; pass seed=None"
                    )
                orch.sampling["seed"] = s
            return orch

        return make

    async def one(i: int, task: Task, a: int):
        s = None if seed is None else eval_attempt_seed(seed, i, a, k)
        async with sem:
            for retry in range(infra_retries + 1):  # noqa: B007 - read after the loop
                trace, _ = await run_rollout(
                    lifecycle,
                    env,
                    task,
                    seeded(s),
                    model,
                    group_id=f"{name}:{task.task_id}:{a}",
                    attempt=a,
                    metadata={"eval": name, "seed": s},
                    timeout_s=timeout_s,
                )
                if trace.status != "infra_error":
                    break
        record = attempt_record(
            trace,
            domain=task.domain,
            attempt=a,
            seed=s,
            pass_threshold=pass_threshold,
            infra_error=infra_error,
            infra_retries=retry,
        )
        if on_attempt is not None:
            on_attempt(record)
        return record, trace

    results = await asyncio.gather(*(one(i, t, a) for i, t in enumerate(tasks) for a in range(k)))
    return EvalResult(name, ids, k, [r for r, _ in results], level, prices, [t for _, t in results])


@dataclasses.dataclass(frozen=True)
class Comparison:
    """after - before per task (paired t over tasks scored in both runs)."""

    metric: str
    estimate: Estimate
    tasks_paired: int
    tasks_dropped: list[str]  # no scored attempt in one of the runs

    def to_dict(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "estimate": self.estimate.to_dict(),
            "excludes_zero": self.estimate.excludes_zero(),
            "tasks_paired": self.tasks_paired,
            "tasks_dropped": list(self.tasks_dropped),
        }


def compare_results(
    after: EvalResult, before: EvalResult, metric: str = "pass", level: float | None = None
) -> Comparison:
    """Paired comparison of two runs on the same tasks (and, where both set
    them, the same attempt seeds): per-task mean of `metric` ("pass" or
    "reward"), after - before, paired t over tasks. level: default after's."""
    if set(after.task_ids) != set(before.task_ids):
        only_a = sorted(set(after.task_ids) - set(before.task_ids))[:5]
        only_b = sorted(set(before.task_ids) - set(after.task_ids))[:5]
        raise ValueError(
            f"compare_results: the runs have different tasks (only in "
            f"{after.name}: {only_a}; only in {before.name}: {only_b}); "
            "evaluate both on the same tasks"
        )
    seeds_b = {(r.task_id, r.attempt): r.seed for r in before.attempts}
    clash = [
        (r.task_id, r.attempt)
        for r in after.attempts
        if r.seed is not None and seeds_b.get((r.task_id, r.attempt)) not in (None, r.seed)
    ]
    if clash:
        raise ValueError(
            f"compare_results: attempts {clash[:3]} used different seeds in the two "
            "runs; pass the same seed (and k) to evaluate"
        )
    a, b = after.per_task(metric), before.per_task(metric)
    both = {
        t: (x, y) for t in after.task_ids if (x := a[t]) is not None and (y := b[t]) is not None
    }
    paired = list(both)
    dropped = [t for t in after.task_ids if t not in both]
    if not paired:
        raise ValueError("compare_results: no task was scored in both runs")
    est = paired_difference(
        [x for x, _ in both.values()],
        [y for _, y in both.values()],
        after.level if level is None else level,
    )
    return Comparison(metric, est, len(paired), dropped)
