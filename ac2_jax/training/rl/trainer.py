"""Task-level RL: rollouts through the endpoint -> rewards -> one update -> publish.

    tasks (domain mix) -> G attempts each through orchestrators over the
    endpoint, concurrently -> verifier rewards -> group advantages ->
    segments -> packed batch -> PPO-clip loss, task_mean -> update ->
    publish weights (Orbax) -> the sampler reloads.

mode="sync" collects step s with the weights of update s. mode="async"
collects step s+1 while step s trains, so sampling and training overlap;
traces lagging more than `max_staleness` versions are dropped or
down-weighted and truncated importance weights correct the rest. Every
collected rollout is appended to `workdir/rollouts.jsonl` as it finishes, and
the shared `Trainer` checkpoints after every step (`workdir/checkpoints/<steps
done>`) and logs train/ metrics (`workdir/metrics`), so a killed run resumes
at the next step without repeating or losing rollouts. Rollouts that end
infra_error (our fault) are retried, counted in the step metrics, and never
trained.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import time
from typing import Any, Callable, Protocol, Sequence

import jax
import numpy as np

from ac2_jax.envs.base import Env
from ac2_jax.orchestration.rollouts import LifecycleClient, OrchestratorFactory, run_rollout
from ac2_jax.trace.store import TraceStore
from ac2_jax.trace.types import Trace
from ac2_jax.training.core.checkpoints import publish
from ac2_jax.training.core.metrics_log import MetricsLogger
from ac2_jax.training.core.objectives import PolicyGradientLoss
from ac2_jax.training.core.state import OptimizerConfig, create_train_state
from ac2_jax.training.core.train_step import TrainStep, make_train_step
from ac2_jax.training.core.trainer import Trainer
from ac2_jax.training.rl.data import BatchConfig, build_batch, trace_rewards

RL_MODES = ("sync", "async")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    steps: int = 10
    tasks_per_step: int = 8
    attempts_per_task: int = 8
    mode: str = "sync"
    seed: int = 0
    concurrency: int = 64
    batch: BatchConfig = BatchConfig()
    loss: PolicyGradientLoss = PolicyGradientLoss()
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-4)
    keep_checkpoints: int = 2

    def __post_init__(self):
        if self.mode not in RL_MODES:
            raise ValueError(f"RLConfig.mode must be one of {RL_MODES}, got {self.mode!r}")
        for name in ("steps", "tasks_per_step", "attempts_per_task", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name} must be >= 1, got {getattr(self, name)}")
        if (self.mode == "async" and self.batch.max_staleness < 1
                and self.batch.stale == "drop"):
            # Async collects step s+1 with the weights of update s - 1: every trace lags
            # one version, so max_staleness=0 with stale="drop" drops every batch.
            raise ValueError("RLConfig: mode='async' needs batch.max_staleness >= 1 (its traces "
                             "lag one version) or batch.stale='downweight'; with "
                             f"max_staleness={self.batch.max_staleness} and stale='drop' "
                             "every step would be dropped")


class Collector(Protocol):
    """Where a step's traces come from."""

    async def collect(self, rl_step: int) -> list[Trace]: ...


class EndpointCollector:
    """G attempts of each step's tasks through the endpoint, concurrently.

    An attempt that ends infra_error (our fault: sampler, network, harness
    crash, or any exception out of `run_rollout`) is run again, up to
    `infra_retries` more times. The last run of every attempt goes to `store`
    tagged with (rl_step, task, attempt) and `infra_retries` (how many runs
    it took, less one); attempts already in the store are reused, not run
    again (resume).

    `rollout_deadline_s` (None: none) bounds each run in wall-clock time: it is
    the rollout's timeout_s on the endpoint (whose sweeper ends it as
    timed_out) and is enforced here too (`run_rollout`'s timeout_s), so a hung
    harness cannot stall the step; such an attempt ends timed_out (counted by
    the step metrics, trained only per BatchConfig.timed_out_reward) and is not
    retried. Lifecycle calls are retried by `lifecycle` itself (its `retries`).
    """

    def __init__(self, lifecycle: LifecycleClient, env: Env, make_orchestrator: OrchestratorFactory,
                 model_name: str, store: TraceStore, *, tasks_per_step: int,
                 attempts_per_task: int, seed: int = 0, concurrency: int = 64,
                 infra_retries: int = 2, rollout_deadline_s: float | None = None):
        if infra_retries < 0:
            raise ValueError(f"EndpointCollector: infra_retries must be >= 0, got {infra_retries}")
        if rollout_deadline_s is not None and not rollout_deadline_s > 0:
            raise ValueError("EndpointCollector: rollout_deadline_s must be > 0 or None, got "
                             f"{rollout_deadline_s}")
        self.rollout_deadline_s, self.concurrency = rollout_deadline_s, concurrency
        self.lifecycle, self.env, self.make = lifecycle, env, make_orchestrator
        self.model_name, self.store = model_name, store
        self.tasks_per_step, self.attempts = tasks_per_step, attempts_per_task
        self.seed, self.sem = seed, asyncio.Semaphore(concurrency)
        self.infra_retries = infra_retries
        # Rollouts a previous (killed) run already stored, read once; each step
        # takes its own out when it is collected.
        self._stored: dict[int, dict[tuple, Trace]] = {}
        for t in store.read(on_error="skip"):
            key = (t.task_id, t.metadata.get("attempt"))
            self._stored.setdefault(t.metadata.get("rl_step"), {})[key] = t

    def tasks(self, rl_step: int):
        return self.env.sample_tasks(self.tasks_per_step, seed=self.seed * 1_000_003 + rl_step,
                                     split="train")

    async def collect(self, rl_step: int) -> list[Trace]:
        done = self._stored.pop(rl_step, {})

        async def one(task, attempt):
            key = (task.task_id, attempt)
            if key in done:
                return done[key]
            for retries in range(self.infra_retries + 1):
                trace = await self._run(task, attempt, rl_step)
                if trace.status != "infra_error":
                    break
                error = trace.metadata.get("artifacts", {}).get("error")
                logging.warning("rl_step %d, %s attempt %d: infra_error (%s); %s", rl_step,
                                task.task_id, attempt, error,
                                "retrying" if retries < self.infra_retries else "giving up")
            trace.attempt_id = str(attempt)
            trace.group_id = f"{rl_step}:{task.task_id}"
            trace.metadata.update(rl_step=rl_step, attempt=attempt, domain=task.domain,
                                  infra_retries=retries)
            self.store.append(trace)
            return trace

        tasks = self.tasks(rl_step)
        dup = sorted(k for k, n in collections.Counter(t.task_id for t in tasks).items() if n > 1)
        if dup:  # ids key groups and resume: duplicates would merge unrelated tasks
            raise ValueError(f"EndpointCollector: rl_step {rl_step} has duplicate task ids "
                             f"{dup[:5]}; task ids must be unique within a step (a DomainMixer "
                             "prefixes them with the domain)")
        jobs = [one(task, a) for task in tasks for a in range(self.attempts)]
        return list(await asyncio.gather(*jobs))

    async def _run(self, task, attempt: int, rl_step: int) -> Trace:
        """One run of an attempt; an exception out of it is an infra_error trace."""
        env = self.env.env_for(task) if hasattr(self.env, "env_for") else self.env
        try:
            async with self.sem:
                trace, _ = await run_rollout(self.lifecycle, env, task, self.make, self.model_name,
                                             group_id=f"{rl_step}:{task.task_id}", attempt=attempt,
                                             metadata={"rl_step": rl_step},
                                             timeout_s=self.rollout_deadline_s)
        except Exception as e:  # noqa: BLE001 - e.g. the endpoint is down: ours, counted
            return Trace(task_id=task.task_id, status="infra_error",
                         metadata={"artifacts": {"error": f"{type(e).__name__}: {e}"}})
        trace.metadata["rollout_id"] = trace.attempt_id  # the endpoint's id for it
        return trace


class ReplayCollector:
    """Replays stored traces by their `rl_step` tag (offline RL, tests)."""

    def __init__(self, traces: Sequence[Trace]):
        self.by_step: dict[int, list[Trace]] = {}
        for t in traces:
            self.by_step.setdefault(int(t.metadata.get("rl_step", 0)), []).append(t)

    async def collect(self, rl_step: int) -> list[Trace]:
        return list(self.by_step.get(rl_step, []))


class RLTrainer:
    """The RL loop around a model. `on_publish(version)` makes the sampler reload.

    A collector that says how it collects (`tasks_per_step`, `attempts`,
    `concurrency` attributes, as EndpointCollector does) must agree with
    `config` (tasks_per_step, attempts_per_task, concurrency): a mismatch is a
    ValueError, never silently one or the other. The loop is a `Trainer`
    (`self.trainer`); logger replaces its `workdir/metrics` sink;
    make_step: e.g. a `StepCache` shared by several trainers.
    """

    def __init__(self, model, collector: Collector, config: RLConfig, workdir: str, *,
                 on_publish: Callable[[int], Any] | None = None, train_mode: str = "jit",
                 mesh=None, logger: MetricsLogger | None = None,
                 make_step: Callable[..., TrainStep] = make_train_step, progress: bool = False):
        for ours, theirs in (("tasks_per_step", "tasks_per_step"),
                             ("attempts_per_task", "attempts"), ("concurrency", "concurrency")):
            have = getattr(collector, theirs, None)
            if have is not None and have != getattr(config, ours):
                raise ValueError(f"RLTrainer: RLConfig.{ours}={getattr(config, ours)} but the "
                                 f"collector's {theirs} is {have}; configure both alike")
        self.config, self.collector, self.on_publish = config, collector, on_publish
        traces = config.tasks_per_step * config.attempts_per_task
        self._batch_config = dataclasses.replace(
            config.batch, task_capacity=config.batch.task_capacity or traces,
            segment_capacity=config.batch.segment_capacity or traces)
        self.workdir = os.path.abspath(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.publish_dir = os.path.join(self.workdir, "published")
        self.graphdef, state = create_train_state(model, config.optimizer, rng=config.seed)
        self.trainer = Trainer(self.graphdef, state, config.loss, config.optimizer,
                               workdir=self.workdir, checkpoint_every=1,
                               keep_checkpoints=config.keep_checkpoints,
                               mode=train_mode, mesh=mesh, make_step=make_step, logger=logger,
                               progress=progress, total_steps=config.steps)
        self.start_step = self.trainer.restore()  # = loop steps done = the next rl_step
        self._published: int | None = None
        self.history: list[dict[str, Any]] = []

    @property
    def step_fn(self) -> TrainStep:
        return self.trainer.step_fn

    @property
    def state(self):
        return self.trainer.state

    @property
    def version(self) -> int:
        """Policy version of the learner = number of updates done."""
        return int(jax.device_get(self.trainer.host_state().step))

    def model(self):
        return self.trainer.model()

    def update(self, traces: Sequence[Trace]) -> dict[str, Any]:
        """One update from traces (the same in sync and async mode)."""
        version = self.version
        batch, stats, adv = build_batch(traces, version, self._batch_config)
        # Rewards of the traces with a verdict (infra_error ones have none).
        rewards = trace_rewards([t for t in traces if t.status != "infra_error"])
        m: dict[str, Any] = {
            "reward_mean": float(rewards.mean()) if len(rewards) else 0.0,
            "pass_rate": float((rewards >= 1.0).mean()) if len(rewards) else 0.0,
            "adv_mean": float(adv.mean()) if len(adv) else 0.0,
            "adv_std": float(adv.std()) if len(adv) else 0.0,
            "adv_abs_mean": float(np.abs(adv).mean()) if len(adv) else 0.0,
            "episodes_per_trace": float(np.mean([len(t.episodes) for t in traces])) if traces else 0.0,
            "agent_tokens": float(sum(t.num_agent_tokens for t in traces)),
            **{k: float(v) for k, v in dataclasses.asdict(stats).items()},
            "infra_retries": float(sum(t.metadata.get("infra_retries", 0) for t in traces)),
        }
        if batch is None or not float(np.abs(batch.advantages * batch.loss_mask).sum()):
            m["skipped_update"] = 1.0  # nothing to learn from (e.g. all rewards equal)
            return m
        m.update(self.trainer.update(batch))
        m["skipped_update"] = 0.0
        return m

    def publish(self) -> int:
        """Writes the learner's weights for the sampler and tells it to reload."""
        version = self._published = self.version
        publish(self.graphdef, self.trainer.host_state(), self.publish_dir, version)
        if self.on_publish is not None:
            self.on_publish(version)
        return version

    async def run(self) -> list[dict[str, Any]]:
        cfg = self.config
        if self.start_step >= cfg.steps:
            # Nothing left to train, but the sampler must serve the trained
            # weights (a rerun would otherwise evaluate whatever it had loaded).
            await asyncio.to_thread(self.publish)
            return self.history
        if self.start_step > 0:
            await asyncio.to_thread(self.publish)  # the sampler serves the restored weights
        pending = asyncio.ensure_future(self.collector.collect(self.start_step))
        for s in range(self.start_step, cfg.steps):
            t0 = time.perf_counter()
            traces = await pending
            t_sample = time.perf_counter() - t0
            if cfg.mode == "async" and s + 1 < cfg.steps:
                pending = asyncio.ensure_future(self.collector.collect(s + 1))
            t1 = time.perf_counter()
            m = await asyncio.to_thread(self.update, traces)
            t2 = time.perf_counter()
            m["policy_version"] = self.version
            if m["policy_version"] != self._published:
                # Off the event loop: rollouts of the next step keep streaming meanwhile.
                await asyncio.to_thread(self.publish)
            t3 = time.perf_counter()
            m.update(rl_step=s, time_sampling_s=t_sample, time_training_s=t2 - t1,
                     time_publishing_s=t3 - t2, time_step_s=time.perf_counter() - t0)
            self.trainer.end_step(m)  # logs train/..., checkpoints (steps done = s + 1)
            if cfg.mode == "sync" and s + 1 < cfg.steps:
                pending = asyncio.ensure_future(self.collector.collect(s + 1))
            self.history.append(m)
        self.trainer.wait()
        return self.history

    def close(self) -> None:
        self.trainer.close()
