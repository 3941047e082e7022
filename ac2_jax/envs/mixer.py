"""Domain mixing: draw tasks from several envs, by fixed or difficulty-adaptive weights.

Each domain samples with its own seed (derived from the mixer seed and the
domain name) and its task ids are prefixed "<domain>/", so two domains built
from the same env class never share tasks or task ids (ids key groups and
resume).

Adaptive mode (`adaptive=AdaptiveMix(...)`): each domain keeps its last
`window` results (solved: reward >= pass_threshold), fed by `record` or
`update(traces)`, and its rolling pass rate p. A domain's share is

    floor x base + (1 - floor) x normalised(base x 4p(1 - p))

where base is its fixed-weight share: 4p(1-p) (the reward variance of a
pass/fail task, 1 at p = 0.5, 0 at p = 0 or 1) favours domains the policy
solves about half the time, where group advantages are non-zero; the floor
keeps every domain at least `floor` of its base share. A domain with fewer
than `min_results` results counts as p = 0.5. If every domain is at p = 0 or
1, the shares are the base shares. Weights are a function of the recorded
sequence only (deterministic).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
from collections.abc import Sequence
from typing import Any

from ac2_jax.envs.base import Env, Task
from ac2_jax.seeds import domain_seed
from ac2_jax.trace.types import RESULT_STATUSES, Trace


@dataclasses.dataclass(frozen=True)
class AdaptiveMix:
    """Adaptive weights: window of results per domain, floor share, warm-up count."""

    window: int = 64
    floor: float = 0.1
    min_results: int = 8
    pass_threshold: float = 1.0

    def __post_init__(self):
        if self.window < 1:
            raise ValueError(f"AdaptiveMix.window must be >= 1, got {self.window}")
        if not 0.0 <= self.floor <= 1.0:
            raise ValueError(
                f"AdaptiveMix.floor must be in [0, 1] (a fraction of each domain's "
                f"fixed-weight share), got {self.floor!r}"
            )
        if not 1 <= self.min_results <= self.window:
            raise ValueError(
                f"AdaptiveMix.min_results must be in [1, window={self.window}] "
                f"(else no domain ever adapts), got {self.min_results}"
            )
        if not math.isfinite(self.pass_threshold):
            raise ValueError(
                f"AdaptiveMix.pass_threshold must be finite, got {self.pass_threshold!r}"
            )


def difficulty_factor(p: float | None) -> float:
    """4p(1-p): 1 at p = 0.5, 0 at p = 0 or 1; 1 for an unknown rate (None)."""
    return 1.0 if p is None else 4.0 * p * (1.0 - p)


class DomainMixer(Env):
    """Samples tasks across envs by weight; `env_for(task)` finds a task's env, which
    runs and verifies the task (`verify`, `reference_answer`, `initial_messages` are
    its; `check_env` checks each domain's env).

    `weights`: the fixed weights (default equal); `adaptive`: adapt them to each
    domain's rolling pass rate (module docstring). `current_weights()` are the
    shares sampling uses now, `pass_rates()` the rolling rates, `metrics()` both
    flat for a metrics log.
    """

    def __init__(
        self,
        envs: dict[str, Env],
        weights: dict[str, float] | None = None,
        *,
        adaptive: AdaptiveMix | None = None,
    ):
        if not envs:
            raise ValueError("DomainMixer needs at least one env")
        self.name = "mix"
        lows, highs = zip(*(e.reward_range for e in envs.values()), strict=True)
        self.reward_range = (min(lows), max(highs))
        self.envs = dict(envs)
        weights = weights or {name: 1.0 for name in envs}
        unknown = set(weights) - set(envs)
        if unknown:
            raise ValueError(f"DomainMixer: weights for unknown envs {sorted(unknown)}")
        if any(not w >= 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"DomainMixer: weights must be >= 0 with a positive sum: {weights}")
        self.weights = {name: float(weights.get(name, 0.0)) for name in envs}
        self.adaptive = adaptive
        window = adaptive.window if adaptive else 1
        self._results: dict[str, collections.deque[float]] = {
            name: collections.deque(maxlen=window) for name in envs
        }
        self.skipped: collections.Counter = collections.Counter()  # traces update() skipped

    def base_shares(self) -> dict[str, float]:
        total = sum(self.weights.values())
        return {k: w / total for k, w in self.weights.items()}

    def pass_rates(self) -> dict[str, float | None]:
        """Each domain's rolling pass rate; None before `min_results` results (or fixed mode)."""
        need = self.adaptive.min_results if self.adaptive else math.inf
        return {k: (sum(r) / len(r) if len(r) >= need else None) for k, r in self._results.items()}

    def current_weights(self) -> dict[str, float]:
        """The shares (summing to 1) that `sample_tasks` draws with now."""
        base = self.base_shares()
        if self.adaptive is None:
            return base
        rates = self.pass_rates()
        raw = {k: base[k] * difficulty_factor(rates[k]) for k in base}
        total = sum(raw.values())
        adapt = {k: v / total for k, v in raw.items()} if total > 0 else base
        floor = self.adaptive.floor
        return {k: floor * base[k] + (1.0 - floor) * adapt[k] for k in base}

    def record(self, task: Task | str, reward: float) -> None:
        """Adds one result of `task` (a Task, or a "<domain>/..." task id) to its domain."""
        if isinstance(task, Task):
            self._record(task.domain, reward, task.task_id)
        else:
            self._record(self._domain_of(task), reward, task)

    def update(self, traces: Sequence[Trace]) -> int:
        """Records the traces with a verdict (finished, agent_error; no reward reads 0),
        in (task_id, attempt_id) order so the result does not depend on arrival
        order; counts the others in `skipped` by status. Returns how many it recorded.
        A trace's domain: its metadata["domain"], else its task id's prefix."""
        recorded = 0
        for t in sorted(traces, key=lambda t: (t.task_id, t.attempt_id)):
            if t.status not in RESULT_STATUSES:  # no verdict on the agent: skipped, counted
                self.skipped[t.status] += 1
                continue
            domain = t.metadata.get("domain") or self._domain_of(t.task_id)
            self._record(domain, float(t.reward or 0.0), t.task_id)
            recorded += 1
        return recorded

    def _domain_of(self, task_id: str) -> str:
        found = [d for d in self.envs if task_id.startswith(f"{d}/")]
        if not found:
            raise ValueError(
                f"DomainMixer: task id {task_id!r} has no '<domain>/' prefix of a "
                f"known domain {sorted(self.envs)}; pass the Task (or a trace with "
                "metadata['domain'])"
            )
        return max(found, key=len)

    def _record(self, domain: str, reward: float, what: str) -> None:
        if self.adaptive is None:
            raise ValueError(
                "DomainMixer.record: this mixer has fixed weights; build it with "
                "adaptive=AdaptiveMix(...) to adapt them to pass rates"
            )
        if domain not in self._results:
            raise ValueError(
                f"DomainMixer.record: unknown domain {domain!r} (of {what!r}); "
                f"domains: {sorted(self._results)}"
            )
        if not math.isfinite(reward):
            raise ValueError(
                f"DomainMixer.record: the reward of {what!r} must be finite, got {reward!r}"
            )
        self._results[domain].append(float(reward >= self.adaptive.pass_threshold))

    def metrics(self) -> dict[str, float]:
        """mix_weight/<domain>, mix_pass_rate/<domain> (once known), mix_results/<domain>,
        mix_skipped: flat floats for a metrics log."""
        out = {f"mix_weight/{k}": v for k, v in self.current_weights().items()}
        out.update({f"mix_pass_rate/{k}": p for k, p in self.pass_rates().items() if p is not None})
        out.update({f"mix_results/{k}": float(len(r)) for k, r in self._results.items()})
        out["mix_skipped"] = float(sum(self.skipped.values()))
        return out

    def state(self) -> dict[str, Any]:
        """The recorded results and skip counts (JSON-able), e.g. to compare two mixers."""
        return {
            "results": {k: list(r) for k, r in self._results.items()},
            "skipped": dict(self.skipped),
        }

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        rng = random.Random(f"mix:{split}:{seed}")
        names = list(self.envs)
        # Fixed mode draws with the weights as given (the task stream of earlier runs).
        weights = self.weights if self.adaptive is None else self.current_weights()
        picks = rng.choices(names, weights=[weights[k] for k in names], k=n)
        tasks = []
        for name in names:
            k = picks.count(name)
            if k:
                for t in self.envs[name].sample_tasks(k, domain_seed(seed, name), split):
                    t.domain = name
                    t.task_id = f"{name}/{t.task_id}"
                    tasks.append(t)
        rng.shuffle(tasks)
        return tasks

    def env_for(self, task: Task) -> Env:
        return self.envs[task.domain]

    def reference_answer(self, task: Task) -> str | None:
        """The task's own env's reference answer (`Env.reference_answer`)."""
        return self.env_for(task).reference_answer(task)

    def verify(self, task: Task, answer: str | None) -> float:
        """The task's own env's reward of `answer`."""
        return self.env_for(task).verify(task, answer)

    def initial_messages(self, task: Task) -> list[dict[str, Any]]:
        return self.env_for(task).initial_messages(task)

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """The task's own env's demonstration (SFT; `check_env` checks every domain has one)."""
        return self.env_for(task).demonstration(task)  # type: ignore[attr-defined]

    def hint(self, task: Task) -> str | None:
        """The task's own env's hint (distillation; `check_env` checks every domain)."""
        return self.env_for(task).hint(task)  # type: ignore[attr-defined]
