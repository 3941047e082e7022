"""Environment QA: can an env's rewards be trusted? Checks over collected traces.

The core, `audit_traces`, is a function of the env, its tasks and traces
already collected (and, for curves, traces per checkpoint); `audit` first runs
K attempts per task through the endpoint. Each check lists the task ids it
flags in `AuditReport.flags[check]`, with what it saw in `details[check]`:

- unsolvable: the env's reference answer (`Env.reference_answer`) does not
  pass its own verifier (tasks without one are counted, not checked);
- never_solved / always_solved: pass rate 0 / 1 over at least `min_attempts`
  attempts (no learning signal; advisory by default);
- sudden_jump: a task's pass rate moves by >= `jump_threshold` between two
  consecutive checkpoints (with few attempts per task, noise can do that);
- nondeterministic_verifier: re-verifying a trace's final answer `reverify`
  times gives a reward other than the one it got;
- reward_out_of_range: a stored, re-verified or reference reward outside the
  env's `reward_range`;
- one check per `predicates` entry: rewarded traces (reward >= pass_threshold)
  for which the predicate holds, e.g. `no_tool_call` (rewarded, no tool call).

A report is `clean` when no check outside `advisory` flags a task.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ac2_jax.envs.base import Env, Task
from ac2_jax.orchestration.rollouts import OrchestratorFactory, run_rollout
from ac2_jax.trace.types import Trace

CHECKS = (
    "unsolvable",
    "never_solved",
    "always_solved",
    "sudden_jump",
    "nondeterministic_verifier",
    "reward_out_of_range",
)
VERDICT_STATUSES = ("finished", "agent_error")  # traces the verifier judged


def count_tool_calls(trace: Trace) -> int:
    """Tool calls of a trace: the larger of its metrics["tool_calls"] (run_rollout
    merges the harness's count) and the distinct calls in its recorded requests."""
    seen: set = set()
    for ei, episode in enumerate(trace.episodes):
        for messages in episode.messages_at():
            for mi, m in enumerate(messages or []):
                for ci, call in enumerate(m.get("tool_calls") or []):
                    seen.add(call.get("id") or (ei, mi, ci))
    return max(int(trace.metrics.get("tool_calls", 0) or 0), len(seen))


def no_tool_call(trace: Trace) -> bool:
    """A predicate for `AuditConfig.predicates`: the trace made no tool call."""
    return count_tool_calls(trace) == 0


@dataclasses.dataclass(frozen=True)
class AuditConfig:
    """reverify: re-verifications per trace (0: off); min_attempts: fewest
    attempts to call a task never/always solved; predicates: name -> (trace ->
    bool), flagged when true of a rewarded trace; advisory: checks that do not
    make a report unclean."""

    reverify: int = 3
    min_attempts: int = 4
    jump_threshold: float = 0.5
    pass_threshold: float = 1.0
    predicates: dict[str, Callable[[Trace], bool]] = dataclasses.field(default_factory=dict)
    advisory: tuple[str, ...] = ("never_solved", "always_solved")

    def __post_init__(self):
        if self.reverify < 0:
            raise ValueError(f"AuditConfig.reverify must be >= 0, got {self.reverify}")
        if self.min_attempts < 1:
            raise ValueError(f"AuditConfig.min_attempts must be >= 1, got {self.min_attempts}")
        if not 0.0 < self.jump_threshold <= 1.0:
            raise ValueError(
                f"AuditConfig.jump_threshold must be in (0, 1] (a pass-rate "
                f"change), got {self.jump_threshold!r}"
            )
        if not math.isfinite(self.pass_threshold):
            raise ValueError(
                f"AuditConfig.pass_threshold must be finite, got {self.pass_threshold!r}"
            )
        clash = sorted(set(self.predicates) & set(CHECKS))
        if clash:
            raise ValueError(
                f"AuditConfig.predicates: names {clash} are built-in checks; rename them"
            )
        bad = [n for n, p in self.predicates.items() if not callable(p)]
        if bad:
            raise ValueError(f"AuditConfig.predicates: {bad} are not callables trace -> bool")
        unknown = sorted(set(self.advisory) - set(CHECKS) - set(self.predicates))
        if unknown:
            raise ValueError(
                f"AuditConfig.advisory: unknown checks {unknown}; known: "
                f"{list(CHECKS) + sorted(self.predicates)}"
            )


@dataclasses.dataclass
class AuditReport:
    """flags: check -> flagged task ids (sorted); details: check -> what was seen;
    counts: what was checked and what could not be; pass_rates: task -> rate over
    the traces; curves: task -> rate per checkpoint (None: no verdict there)."""

    flags: dict[str, list[str]]
    details: dict[str, list[dict[str, Any]]]
    counts: dict[str, int]
    pass_rates: dict[str, float]
    curves: dict[str, list[float | None]]
    checkpoints: list[str]
    advisory: tuple[str, ...]

    @property
    def clean(self) -> bool:
        return not any(ids for check, ids in self.flags.items() if check not in self.advisory)

    def to_dict(self) -> dict[str, Any]:
        return {
            "clean": self.clean,
            "flags": self.flags,
            "details": self.details,
            "counts": self.counts,
            "pass_rates": self.pass_rates,
            "curves": self.curves,
            "checkpoints": self.checkpoints,
            "advisory": list(self.advisory),
        }


def _env_of(env, task: Task) -> Env:
    return env.env_for(task) if hasattr(env, "env_for") else env


def _in_range(env: Env, reward: float) -> bool:
    lo, hi = env.reward_range
    return lo <= reward <= hi


def _by_task(traces: Sequence[Trace], tasks: Mapping[str, Task], what: str) -> dict:
    unknown = sorted({t.task_id for t in traces} - set(tasks))
    if unknown:
        raise ValueError(
            f"audit: {what} has traces of tasks not given: {unknown[:5]}; pass "
            "the Task of every trace (its verifier needs it)"
        )
    out: dict[str, list[Trace]] = collections.defaultdict(list)
    for t in traces:
        out[t.task_id].append(t)
    return out


def _pass_rate(traces: Sequence[Trace], threshold: float) -> float | None:
    judged = [t for t in traces if t.status in VERDICT_STATUSES]
    if not judged:
        return None
    return sum(float(t.reward or 0.0) >= threshold for t in judged) / len(judged)


def audit_traces(
    env,
    tasks: Sequence[Task],
    traces: Sequence[Trace],
    config: AuditConfig = AuditConfig(),
    *,
    by_checkpoint: Mapping[str, Sequence[Trace]] | None = None,
) -> AuditReport:
    """Runs every check (module docstring) on `traces` of `tasks` in `env` (an Env
    or a DomainMixer). `by_checkpoint`: label -> traces, in checkpoint order, for
    the pass-rate curves. Calls only `env.verify` and `env.reference_answer`."""
    task_map = {t.task_id: t for t in tasks}
    flags: dict[str, set[str]] = {c: set() for c in (*CHECKS, *config.predicates)}
    details: dict[str, list[dict]] = {c: [] for c in flags}
    counts = collections.Counter(tasks=len(task_map), traces=len(traces))

    def flag(check, task_id, **seen):
        flags[check].add(task_id)
        details[check].append({"task_id": task_id, **seen})

    def verify(task, answer):
        """(reward, None) or (None, error text): a raising verifier is a finding too."""
        try:
            return float(_env_of(env, task).verify(task, answer)), None
        except Exception as e:  # noqa: BLE001 - reported in the check's details
            return None, f"{type(e).__name__}: {e}"

    for task in task_map.values():
        reference = _env_of(env, task).reference_answer(task)
        if reference is None:
            counts["tasks_without_reference"] += 1
            continue
        reward, error = verify(task, reference)
        if reward is None or reward < config.pass_threshold:
            flag("unsolvable", task.task_id, reference=reference, reward=reward, error=error)
        if reward is not None and not _in_range(_env_of(env, task), reward):
            flag("reward_out_of_range", task.task_id, source="reference", reward=reward)

    grouped = _by_task(traces, task_map, "traces")
    pass_rates = {}
    for task_id, group in sorted(grouped.items()):
        judged = [t for t in group if t.status in VERDICT_STATUSES]
        counts["traces_without_verdict"] += len(group) - len(judged)
        rate = _pass_rate(judged, config.pass_threshold)
        if rate is None:
            continue
        pass_rates[task_id] = rate
        if len(judged) < config.min_attempts:
            counts["tasks_with_too_few_attempts"] += 1
        elif rate == 0.0:
            flag("never_solved", task_id, attempts=len(judged))
        elif rate == 1.0:
            flag("always_solved", task_id, attempts=len(judged))

    for t in traces:
        task, task_env = task_map[t.task_id], _env_of(env, task_map[t.task_id])
        if t.reward is not None and not _in_range(task_env, float(t.reward)):
            flag(
                "reward_out_of_range",
                t.task_id,
                source="trace",
                attempt_id=t.attempt_id,
                reward=t.reward,
            )
        rewarded = (
            t.status in VERDICT_STATUSES
            and t.reward is not None
            and float(t.reward) >= config.pass_threshold
        )
        for name, predicate in config.predicates.items():
            if rewarded and predicate(t):
                flag(name, t.task_id, attempt_id=t.attempt_id, reward=t.reward)
        artifacts = t.metadata.get("artifacts") or {}
        if config.reverify and (
            t.reward is None or t.status not in VERDICT_STATUSES or "answer" not in artifacts
        ):
            counts["traces_not_reverified"] += 1  # no verdict, or no answer to re-verify
            continue
        for _ in range(config.reverify):
            reward, error = verify(task, artifacts["answer"])
            counts["reverifications"] += 1
            if reward is not None and not _in_range(task_env, reward):
                flag(
                    "reward_out_of_range",
                    t.task_id,
                    source="reverify",
                    attempt_id=t.attempt_id,
                    reward=reward,
                )
            if t.reward is not None and reward != float(t.reward):
                flag(
                    "nondeterministic_verifier",
                    t.task_id,
                    attempt_id=t.attempt_id,
                    stored=t.reward,
                    reverified=reward,
                    error=error,
                )
                break

    labels = [str(k) for k in (by_checkpoint or {})]
    curves: dict[str, list[float | None]] = {}
    if by_checkpoint:
        per_ckpt = [
            _by_task(ts, task_map, f"checkpoint {label!r}")
            for label, ts in zip(labels, by_checkpoint.values(), strict=True)
        ]
        for task_id in sorted({tid for g in per_ckpt for tid in g}):
            curve = [_pass_rate(g.get(task_id, []), config.pass_threshold) for g in per_ckpt]
            curves[task_id] = curve
            points = [(label, r) for label, r in zip(labels, curve, strict=True) if r is not None]
            for (a, ra), (b, rb) in zip(points, points[1:], strict=False):
                if abs(rb - ra) >= config.jump_threshold:
                    flag("sudden_jump", task_id, checkpoints=[a, b], pass_rates=[ra, rb])

    return AuditReport(
        flags={c: sorted(ids) for c, ids in flags.items()},
        details=details,
        counts=dict(counts),
        pass_rates=pass_rates,
        curves=curves,
        checkpoints=labels,
        advisory=tuple(config.advisory),
    )


async def audit(
    lifecycle,
    env,
    tasks: Sequence[Task],
    make_orchestrator: OrchestratorFactory,
    model: str,
    *,
    attempts: int = 4,
    config: AuditConfig = AuditConfig(),
    concurrency: int = 32,
    name: str = "audit",
) -> tuple[AuditReport, list[Trace]]:
    """Runs `attempts` rollouts of every task through the endpoint (`run_rollout`),
    then `audit_traces` on them. Returns (report, traces). Lifecycle errors propagate."""
    if attempts < 1:
        raise ValueError(f"audit: attempts must be >= 1, got {attempts}")
    sem = asyncio.Semaphore(concurrency)

    async def one(task: Task, attempt: int) -> Trace:
        async with sem:
            trace, _ = await run_rollout(
                lifecycle,
                env,
                task,
                make_orchestrator,
                model,
                group_id=f"{name}:{task.task_id}",
                attempt=attempt,
                metadata={"audit": name},
            )
        return trace

    traces = list(await asyncio.gather(*(one(t, a) for t in tasks for a in range(attempts))))
    return audit_traces(env, tasks, traces, config), traces
