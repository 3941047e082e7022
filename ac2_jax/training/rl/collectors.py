"""Where an RL step's traces come from: the endpoint (`EndpointCollector`), or a replay.

`EndpointCollector` runs G attempts of each step's tasks through the endpoint
concurrently, retries infra errors, stores every attempt as it finishes
(resume reuses them), and for dynamic sampling runs refill rounds of new tasks.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
from collections.abc import Sequence
from typing import Protocol

from ac2_jax.envs.base import Env
from ac2_jax.orchestration.rollouts import LifecycleClient, OrchestratorFactory, run_rollout
from ac2_jax.seeds import refill_seed, rl_attempt_seed
from ac2_jax.trace.store import TraceStore
from ac2_jax.trace.types import Trace


class Collector(Protocol):
    """Where a step's traces come from. Dynamic sampling also needs
    `refill(rl_step, round, n) -> (traces, repeated)`: n more tasks' attempts."""

    async def collect(self, rl_step: int) -> list[Trace]: ...


class EndpointCollector:
    """G attempts of each step's tasks through the endpoint, concurrently.

    An attempt that ends infra_error (our fault: sampler, network, harness
    crash, or any exception out of `run_rollout`) is run again, up to
    `infra_retries` more times. The last run of every attempt goes to `store`
    tagged with (rl_step, task, attempt) and `infra_retries` (how many runs
    it took, less one); attempts already in the store are reused, not run
    again (resume). Each rerun waits first, capped exponential backoff with
    jitter: retry r (1, 2, ...) sleeps a uniform draw from
    [d / 2, d] with d = min(infra_backoff_max_s, infra_backoff_s * 2^(r - 1))
    (an endpoint that restarts gets the time to come back instead of eating
    every retry at once); `backoff_s` and `backoff_sleeps` count them.

    `rollout_deadline_s` (None: none) bounds each run in wall-clock time: it is
    the rollout's timeout_s on the endpoint (whose sweeper ends it as
    timed_out) and is enforced here too (`run_rollout`'s timeout_s), so a hung
    harness cannot stall the step; such an attempt ends timed_out (counted by
    the step metrics, trained only per BatchConfig.timed_out_reward) and is not
    retried. Lifecycle calls are retried by `lifecycle` itself (its `retries`).

    Every attempt samples with its own seed, `ac2_jax.seeds.rl_attempt_seed(seed,
    rl_step, task_id, attempt)`, put in its orchestrator's `sampling` dict
    (each request of the attempt then gets its own, `request_seed`; an infra
    retry reuses it). Unseeded, the sampler would draw a request's seed in the
    order requests arrive, which timing decides, so no two runs sampled alike.
    An orchestrator without a `sampling` dict samples unseeded.

    `refill(rl_step, round, n)` runs the attempts of n more tasks of the step
    (seed `refill_seed`), leaving out (and counting) tasks already run in it;
    refill traces carry metadata["refill"] = round (0: the step's own tasks).
    `stored(rl_step)` is what a previous run stored for a step (resume).
    """

    def __init__(
        self,
        lifecycle: LifecycleClient,
        env: Env,
        make_orchestrator: OrchestratorFactory,
        model_name: str,
        store: TraceStore,
        *,
        tasks_per_step: int,
        attempts_per_task: int,
        seed: int = 0,
        concurrency: int = 64,
        infra_retries: int = 2,
        rollout_deadline_s: float | None = None,
        infra_backoff_s: float = 1.0,
        infra_backoff_max_s: float = 30.0,
    ):
        if not 0 <= infra_backoff_s <= infra_backoff_max_s:
            raise ValueError(
                f"EndpointCollector: need 0 <= infra_backoff_s <= infra_backoff_max_s, got "
                f"{infra_backoff_s} and {infra_backoff_max_s}"
            )
        if infra_retries < 0:
            raise ValueError(f"EndpointCollector: infra_retries must be >= 0, got {infra_retries}")
        if rollout_deadline_s is not None and not rollout_deadline_s > 0:
            raise ValueError(
                "EndpointCollector: rollout_deadline_s must be > 0 or None, got "
                f"{rollout_deadline_s}"
            )
        self.rollout_deadline_s, self.concurrency = rollout_deadline_s, concurrency
        self.lifecycle, self.env, self.make = lifecycle, env, make_orchestrator
        self.model_name, self.store = model_name, store
        self.tasks_per_step, self.attempts = tasks_per_step, attempts_per_task
        self.seed, self.sem = seed, asyncio.Semaphore(concurrency)
        self.infra_retries = infra_retries
        self.infra_backoff_s, self.infra_backoff_max_s = infra_backoff_s, infra_backoff_max_s
        self._jitter = random.Random(seed)  # the backoff's jitter (timing only)
        self.backoff_s = 0.0  # seconds slept before infra reruns, in all
        self.backoff_sleeps = 0
        # Rollouts a previous (killed) run already stored, read once; each step
        # takes its own out when it is collected.
        # (Traces without an rl_step tag land under None.)
        self._stored: dict[int | None, dict[tuple, Trace]] = {}
        for t in store.iter_traces(on_error="skip"):
            key = (t.task_id, t.metadata.get("attempt"))
            self._stored.setdefault(t.metadata.get("rl_step"), {})[key] = t
        # The step being collected: its stored attempts and the task ids it has run.
        self._step: tuple[int, dict[tuple, Trace], set[str]] | None = None

    def tasks(self, rl_step: int):
        return self.env.sample_tasks(
            self.tasks_per_step, seed=self.seed * 1_000_003 + rl_step, split="train"
        )

    def stored(self, rl_step: int) -> list[Trace]:
        """The traces a previous run stored for `rl_step` (not yet collected again)."""
        return list(self._stored.get(rl_step, {}).values())

    async def collect(self, rl_step: int) -> list[Trace]:
        self._step = (rl_step, self._stored.pop(rl_step, {}), set())
        return await self._attempts(rl_step, self.tasks(rl_step), 0)

    async def refill(self, rl_step: int, round: int, n: int) -> tuple[list[Trace], int]:
        """The attempts of n more tasks of `rl_step` (refill `round` >= 1), and how
        many of the n were left out because the step has run them already."""
        if self._step is None or self._step[0] != rl_step:
            raise ValueError(
                f"EndpointCollector.refill: rl_step {rl_step} is not the step "
                "being collected; call collect(rl_step) first"
            )
        tasks = self.env.sample_tasks(n, seed=refill_seed(self.seed, rl_step, round), split="train")
        fresh = [t for t in tasks if t.task_id not in self._step[2]]
        if len(fresh) < len(tasks):
            logging.warning(
                "rl_step %d refill %d: %d of %d tasks were run in this step already; left out",
                rl_step,
                round,
                len(tasks) - len(fresh),
                len(tasks),
            )
        return await self._attempts(rl_step, fresh, round), len(tasks) - len(fresh)

    async def _attempts(self, rl_step: int, tasks, round: int) -> list[Trace]:
        assert self._step is not None  # set by collect() first
        _, done, used = self._step

        async def one(task, attempt):
            key = (task.task_id, attempt)
            if key in done:
                return done[key]
            for retries in range(self.infra_retries + 1):
                if retries:
                    await self._backoff(retries)
                trace = await self._run(task, attempt, rl_step)
                if trace.status != "infra_error":
                    break
                error = trace.metadata.get("artifacts", {}).get("error")
                logging.warning(
                    "rl_step %d, %s attempt %d: infra_error (%s); %s",
                    rl_step,
                    task.task_id,
                    attempt,
                    error,
                    "retrying" if retries < self.infra_retries else "giving up",
                )
            trace.attempt_id = str(attempt)
            trace.group_id = f"{rl_step}:{task.task_id}"
            trace.metadata.update(
                rl_step=rl_step,
                attempt=attempt,
                domain=task.domain,
                infra_retries=retries,
                refill=round,
            )
            # Flushed and fsynced in a worker thread: on the event loop each fsync
            # would stall every other rollout's requests.
            await asyncio.to_thread(self.store.append, trace)
            return trace

        dup = sorted(k for k, n in collections.Counter(t.task_id for t in tasks).items() if n > 1)
        if dup:  # ids key groups and resume: duplicates would merge unrelated tasks
            raise ValueError(
                f"EndpointCollector: rl_step {rl_step} has duplicate task ids "
                f"{dup[:5]}; task ids must be unique within a step (a DomainMixer "
                "prefixes them with the domain)"
            )
        used.update(t.task_id for t in tasks)
        jobs = [one(task, a) for task in tasks for a in range(self.attempts)]
        return list(await asyncio.gather(*jobs))

    async def _backoff(self, retry: int) -> None:
        """Waits before infra rerun `retry` (>= 1): see the class docstring."""
        cap = min(self.infra_backoff_max_s, self.infra_backoff_s * 2 ** (retry - 1))
        wait = cap * (0.5 + 0.5 * self._jitter.random())
        self.backoff_s += wait
        self.backoff_sleeps += 1
        if wait > 0:
            await asyncio.sleep(wait)

    async def _run(self, task, attempt: int, rl_step: int) -> Trace:
        """One run of an attempt; an exception out of it is an infra_error trace."""
        env = self.env.env_for(task) if hasattr(self.env, "env_for") else self.env
        seed = rl_attempt_seed(self.seed, rl_step, task.task_id, attempt)

        def make(env_, task_, client, model_name):
            orch = self.make(env_, task_, client, model_name)
            if isinstance(getattr(orch, "sampling", None), dict):
                orch.sampling["seed"] = seed
            return orch

        try:
            async with self.sem:
                trace, _ = await run_rollout(
                    self.lifecycle,
                    env,
                    task,
                    make,
                    self.model_name,
                    group_id=f"{rl_step}:{task.task_id}",
                    attempt=attempt,
                    metadata={"rl_step": rl_step},
                    timeout_s=self.rollout_deadline_s,
                )
        except Exception as e:  # noqa: BLE001 - e.g. the endpoint is down: ours, counted
            return Trace(
                task_id=task.task_id,
                status="infra_error",
                metadata={"artifacts": {"error": f"{type(e).__name__}: {e}"}},
            )
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
