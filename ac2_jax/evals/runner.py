"""Repeated-run evals over an endpoint: pass rate with CI, process and cost metrics."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Sequence

import numpy as np

from ac2_jax.envs.base import Env, Task
from ac2_jax.evals.stats import Estimate, wilson_interval
from ac2_jax.orchestration.rollouts import LifecycleClient, OrchestratorFactory, run_rollout

PROCESS_METRICS = ("steps", "tool_calls", "tool_errors", "prompt_tokens", "output_tokens",
                   "wall_time_s")


@dataclasses.dataclass
class EvalResult:
    """Rewards per task (in task order) and their summaries."""

    name: str
    task_ids: list[str]
    rewards: list[float]
    metrics: dict[str, float]

    @property
    def pass_rate(self) -> Estimate:
        return wilson_interval(int(sum(r >= 1.0 for r in self.rewards)), len(self.rewards))

    def to_dict(self) -> dict[str, Any]:
        p = self.pass_rate
        return {"name": self.name, "n": len(self.rewards), "pass_rate": p.mean,
                "pass_rate_ci95": [p.low, p.high], "metrics": self.metrics}


async def evaluate(lifecycle: LifecycleClient, env: Env, tasks: Sequence[Task],
                   make_orchestrator: OrchestratorFactory, model: str, *, name: str = "eval",
                   concurrency: int = 32) -> EvalResult:
    """Runs every task once through the endpoint (greedy or as sampled by the factory)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(task: Task):
        async with sem:
            return await run_rollout(lifecycle, env, task, make_orchestrator, model,
                                     group_id=f"{name}:{task.task_id}",
                                     metadata={"eval": name})

    results = await asyncio.gather(*(one(t) for t in tasks))
    rewards = [float(tr.reward or 0.0) for tr, _ in results]
    metrics = {k: float(np.mean([conv.metrics.get(k, 0.0) for _, conv in results]))
               for k in PROCESS_METRICS}
    metrics["episodes_per_trace"] = float(np.mean([len(tr.episodes) for tr, _ in results]))
    return EvalResult(name, [t.task_id for t in tasks], rewards, metrics)
