"""The RL driver split into processes: a collector and a learner that meet only
at the endpoint, the trace store and the published checkpoints, so either side
scales (or restarts) alone.

    endpoint   python -m ac2_jax.serving --model=M --publish_dir=RUN/published ...
    collector  run_collector(EndpointCollector(...), lifecycle, StepMarkers.of(store), ...)
               step s: waits until the endpoint says the learner has finished at
               least s - max_staleness steps (`learner_step`, GET /v1/models),
               runs the step's rollouts through the endpoint (each trace appended
               to the TraceStore as it ends), then marks the step complete.
    learner    RLTrainer(model, StoreCollector(store, markers), config, RUN,
                         on_progress=tell_endpoint(lifecycle)); run_learner(trainer)
               step s: waits for step s's marker, reads its traces from the
               store, trains, checkpoints (Orbax), publishes to RUN/published and
               tells the endpoint (POST /v1/admin/load_weights {step: version,
               learner_step: steps done}). A step whose groups all tie updates
               nothing: steps done moves on, the version does not.

The loop is the one `RLTrainer` and the one `EndpointCollector`; only the
channel between them differs from the in-process driver (a marker file and
the store instead of an awaited call).

Staleness. Traces of step s are sampled by weights at least as new as the
learner's after s - max_staleness steps and trained by its weights after s
steps, so no trace lags more than max_staleness versions. max_staleness=0 is
the in-process sync loop, 1 its async loop (step s+1 is collected while step
s trains). A learner whose `BatchConfig.max_staleness` is smaller than the
collector's would drop traces: it refuses the step instead, naming both.

Crash safety. The store fsyncs each trace and skips a torn last line on read;
a step's marker is written (temp file, fsync, rename) only after every trace
of the step is in the store and records their count, so the learner never
trains a partial step and notices a lost line. A restarted collector resumes
at the first step without a marker, reusing the attempts already stored for
it (EndpointCollector); a restarted learner resumes from its Orbax checkpoint
(RLTrainer), republishes and tells the endpoint. A restarted endpoint knows no
learner_step: the learner tells it again as soon as it reports another one than
the last told (`run_learner`), or the collector, paced on it, and the learner,
waiting for the collector's next step, would wait for each other for good; an
endpoint that is down when told is told once it is back, without stopping the
learner. (tests/training/rl/test_faults.py injects these faults and more.)

Dynamic sampling (refills) needs the learner to ask the collector for more
tasks mid-step; the split driver does not offer it (RLTrainer refuses it).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from ac2_jax.envs.mixer import DomainMixer
from ac2_jax.orchestration.rollouts import LifecycleClient, LifecycleError
from ac2_jax.trace.store import TraceStore
from ac2_jax.trace.types import Trace
from ac2_jax.training.core.watchdog import Watchdog
from ac2_jax.training.rl.alarms import AlarmsConfig
from ac2_jax.training.rl.collectors import EndpointCollector

_MARKER = re.compile(r"^(\d+)\.json$")


class StepMarkers:
    """One JSON file per collected step in `directory` (`<step>.json`), written
    atomically after the step's traces are in the store."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.path.abspath(os.fspath(directory))

    @classmethod
    def of(cls, store: TraceStore) -> StepMarkers:
        """The markers next to a store: `rollouts.jsonl` -> `rollouts.steps/`."""
        return cls(os.path.splitext(os.path.abspath(store.path))[0] + ".steps")

    def path(self, rl_step: int) -> str:
        return os.path.join(self.directory, f"{int(rl_step)}.json")

    def mark(self, rl_step: int, info: dict[str, Any]) -> None:
        """Records step `rl_step` as complete (temp file, fsync, rename, fsync dir)."""
        os.makedirs(self.directory, exist_ok=True)
        final = self.path(rl_step)
        tmp = f"{final}.tmp-{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({**info, "rl_step": int(rl_step)}, f, allow_nan=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def read(self, rl_step: int) -> dict[str, Any] | None:
        """The marker of `rl_step`, or None while the step is not complete."""
        try:
            with open(self.path(rl_step), encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def steps(self) -> list[int]:
        """The complete steps, ascending."""
        if not os.path.isdir(self.directory):
            return []
        return sorted(
            int(m.group(1)) for n in os.listdir(self.directory) if (m := _MARKER.match(n))
        )

    def next_step(self) -> int:
        """The first step without a marker (where a restarted collector goes on)."""
        done, s = set(self.steps()), 0
        while s in done:
            s += 1
        return s


def step_traces(store: TraceStore, rl_step: int) -> tuple[list[Trace], int]:
    """The stored traces tagged `rl_step`, one per (task, attempt) (the last one
    stored wins), and how many duplicates that left out."""
    by_key: dict[tuple, Trace] = {}
    n = 0
    for t in store.iter_traces(on_error="skip"):  # a torn last line: warned, skipped
        if t.metadata.get("rl_step") == rl_step:
            by_key[(t.task_id, t.metadata.get("attempt"))] = t
            n += 1
    return list(by_key.values()), n - len(by_key)


class StoreCollector:
    """The learner's side: a step's traces are what the collector process stored,
    once its marker says the step is complete (see the module docstring).

    tasks_per_step / attempts_per_task / max_staleness: what the learner is
    configured for; a marker written with other values is a ValueError naming
    both (the processes must share one config). timeout_s: give up waiting for
    a marker (None: wait for good). `duplicates` counts stored traces left
    out because a later run of the same attempt was stored.
    """

    def __init__(
        self,
        store: TraceStore,
        markers: StepMarkers | None = None,
        *,
        tasks_per_step: int | None = None,
        attempts_per_task: int | None = None,
        max_staleness: int | None = None,
        poll_s: float = 0.2,
        timeout_s: float | None = None,
    ):
        self.store, self.markers = store, markers or StepMarkers.of(store)
        self.tasks_per_step, self.attempts = tasks_per_step, attempts_per_task
        self.max_staleness, self.poll_s, self.timeout_s = max_staleness, poll_s, timeout_s
        self.duplicates = 0

    async def wait_marker(self, rl_step: int) -> dict[str, Any]:
        t0, last_log = time.monotonic(), time.monotonic()
        while (marker := self.markers.read(rl_step)) is None:
            if self.timeout_s is not None and time.monotonic() - t0 > self.timeout_s:
                raise TimeoutError(
                    f"StoreCollector: no marker for rl_step {rl_step} in "
                    f"{self.markers.directory} after {self.timeout_s} s; is "
                    "the collector process running?"
                )
            if time.monotonic() - last_log > 60:
                logging.info(
                    "learner: waiting for rl_step %d's traces (%.0f s)",
                    rl_step,
                    time.monotonic() - t0,
                )
                last_log = time.monotonic()
            await asyncio.sleep(self.poll_s)
        self._check(rl_step, marker)
        return marker

    def _check(self, rl_step: int, marker: dict[str, Any]) -> None:
        for ours, theirs, mine in (
            ("tasks_per_step", "tasks_per_step", self.tasks_per_step),
            ("attempts_per_task", "attempts_per_task", self.attempts),
        ):
            if mine is not None and marker.get(theirs) != mine:
                raise ValueError(
                    f"StoreCollector: rl_step {rl_step} was collected with "
                    f"{theirs}={marker.get(theirs)}, the learner has "
                    f"RLConfig.{ours}={mine}; run both processes with one config"
                )
        lead = marker.get("max_staleness")
        if self.max_staleness is not None and lead is not None and lead > self.max_staleness:
            raise ValueError(
                f"StoreCollector: the collector runs up to {lead} steps ahead "
                f"(max_staleness={lead}) but the learner's "
                f"BatchConfig.max_staleness is {self.max_staleness}: its traces "
                "would be dropped as stale. Give both the same max_staleness"
            )

    async def collect(self, rl_step: int) -> list[Trace]:
        marker = await self.wait_marker(rl_step)
        traces, dup = await asyncio.to_thread(step_traces, self.store, rl_step)
        self.duplicates += dup
        if len(traces) != marker["traces"]:
            raise RuntimeError(
                f"StoreCollector: {self.store.path} holds {len(traces)} traces "
                f"of rl_step {rl_step} but its marker says {marker['traces']}: "
                "a stored line was lost or the store was replaced; delete the "
                f"marker {self.markers.path(rl_step)} and restart the collector "
                "to run the missing attempts again"
            )
        return traces

    def stored(self, rl_step: int) -> list[Trace]:
        """The stored traces of a step (for an adaptive mixer's replay)."""
        return step_traces(self.store, rl_step)[0]


async def _models(lifecycle: LifecycleClient) -> dict[str, Any] | None:
    """The admin's model entry, or None while the endpoint is down or starting."""
    try:
        return await lifecycle.models()
    except httpx.TransportError:
        return None
    except LifecycleError as e:
        if e.status_code is not None and e.status_code >= 500:
            return None
        raise


async def endpoint_weights(lifecycle: LifecycleClient) -> dict[str, Any] | None:
    """What the endpoint serves, for the weights alarm (`RLTrainer(served_weights=)`):
    its sampler's `served_weights()` report from the admin's /v1/models entry, or
    {"version": its policy_version, "checksum": None} when its sampler gives none
    (the version is checked, the checksum counted unverified); None while the
    endpoint is down."""
    entry = await _models(lifecycle)
    if entry is None:
        return None
    return entry.get("served_weights") or {"version": entry.get("policy_version"), "checksum": None}


async def wait_for_endpoint(
    lifecycle: LifecycleClient, *, poll_s: float = 0.2, timeout_s: float | None = None
) -> dict[str, Any]:
    """Polls GET /v1/models until the endpoint answers (it may start after this
    process); returns the model entry. A 4xx (e.g. a wrong admin key) is raised."""
    return await wait_for_learner(lifecycle, None, poll_s=poll_s, timeout_s=timeout_s)


async def wait_for_learner(
    lifecycle: LifecycleClient,
    learner_step: int | None,
    *,
    poll_s: float = 0.2,
    timeout_s: float | None = None,
) -> dict[str, Any]:
    """Polls the admin's GET /v1/models until the endpoint reports a learner that has
    finished >= `learner_step` loop steps (and so serves its weights after them);
    returns that model entry (policy_version, learner_step). learner_step None:
    until the endpoint answers at all. An endpoint that is down or restarting
    is waited for, like a learner that is behind."""
    t0, last_log = time.monotonic(), time.monotonic()
    while True:
        entry = await _models(lifecycle)
        have = None if entry is None else entry.get("learner_step")
        if entry is not None and (
            learner_step is None or (have is not None and have >= learner_step)
        ):
            return entry
        if timeout_s is not None and time.monotonic() - t0 > timeout_s:
            seen = (
                "no answer from the endpoint at " + lifecycle.base_url
                if entry is None
                else f"the endpoint reports learner_step={have}, needed >= {learner_step}"
            )
            raise TimeoutError(
                f"wait_for_learner: {seen} after {timeout_s} s; are the "
                "endpoint and the learner process running, with these URLs?"
            )
        if time.monotonic() - last_log > 60:
            logging.info(
                "collector: waiting for the learner (learner_step %s, need %d)", have, learner_step
            )
            last_log = time.monotonic()
        await asyncio.sleep(poll_s)


async def run_collector(
    collector: EndpointCollector,
    lifecycle: LifecycleClient,
    markers: StepMarkers,
    *,
    steps: int,
    max_staleness: int = 0,
    poll_s: float = 0.2,
    timeout_s: float | None = None,
    log: Callable[[str], Any] = logging.info,
    alarms: AlarmsConfig | None = None,
) -> list[int]:
    """The collector process's loop: steps `markers.next_step()` .. steps - 1
    (see the module docstring); returns the steps it collected. `alarms` (default
    on): its hang watchdog watches each step's collection (`alarms.hang`: the
    stacks of every thread logged, then the process exits non-zero or warns)."""
    alarms = alarms if alarms is not None else AlarmsConfig()
    dog = (
        Watchdog(alarms.hang.threshold, alarms.hang.action, where="collector")
        if alarms.on("hang")
        else None
    )
    try:
        return await _collect_steps(
            collector, lifecycle, markers, steps, max_staleness, poll_s, timeout_s, log, dog
        )
    finally:
        if dog is not None:
            dog.close()


async def _collect_steps(
    collector: EndpointCollector,
    lifecycle: LifecycleClient,
    markers: StepMarkers,
    steps: int,
    max_staleness: int,
    poll_s: float,
    timeout_s: float | None,
    log: Callable[[str], Any],
    dog: Watchdog | None,
) -> list[int]:
    if max_staleness < 0:
        raise ValueError(f"run_collector: max_staleness must be >= 0, got {max_staleness}")
    await wait_for_endpoint(lifecycle, poll_s=poll_s, timeout_s=timeout_s)
    start = markers.next_step()
    env = collector.env
    mixer = env if isinstance(env, DomainMixer) and env.adaptive is not None else None
    for s in range(start if mixer is not None else 0):  # as the learner would have fed it
        assert mixer is not None  # the range is empty otherwise
        mixer.update(collector.stored(s))
    done = []
    for s in range(start, steps):
        served = await wait_for_learner(
            lifecycle, s - max_staleness, poll_s=poll_s, timeout_s=timeout_s
        )
        if dog is None:
            traces = await collector.collect(s)
        else:
            with dog.stage("collection"):
                traces = await collector.collect(s)
        if mixer is not None:
            mixer.update(traces)
        versions = sorted(
            {c.policy_version for t in traces for e in t.episodes for c in e.completions}
        )
        markers.mark(
            s,
            {
                "traces": len(traces),
                "tasks_per_step": collector.tasks_per_step,
                "attempts_per_task": collector.attempts,
                "max_staleness": max_staleness,
                "learner_step": served["learner_step"],
                "served_version": served["policy_version"],
                "policy_versions": versions,
                "infra_errors": sum(t.status == "infra_error" for t in traces),
            },
        )
        log(f"collected rl_step={s} traces={len(traces)} versions={versions}")
        done.append(s)
    return done


def tell_endpoint(lifecycle: LifecycleClient) -> Callable[[int, int], Awaitable[int]]:
    """`RLTrainer(on_progress=...)` for a learner in its own process: the endpoint serves
    published step `version` and records `learner_step=steps_done` (the collector paces
    itself on it). Not `lifecycle.load_weights` itself: that takes (step, learner_step),
    the trainer calls (steps_done, version). The two agree until a step updates nothing
    (every group tied, zero advantage): then steps_done is ahead of the version, and the
    swapped call asked for a step never published (404) and stopped the learner."""

    async def tell(steps_done: int, version: int) -> int:
        return await lifecycle.load_weights(version, learner_step=steps_done)

    return tell


class _ToldEndpoint:
    """The learner's `on_progress`, remembered: `keep` tells the endpoint again
    whenever it reports another learner_step than the last one told (a restarted
    endpoint knows none: the collector, paced on it, would wait for good while
    the learner waits for the collector's next step), and an endpoint that is
    down when told is told once it is back, instead of stopping the learner.
    Tells run one at a time, so a late one never rolls a newer one back."""

    def __init__(self, tell: Callable[[int, int], Any], lifecycle: LifecycleClient):
        self.tell, self.lifecycle = tell, lifecycle
        self.last: tuple[int, int] | None = None
        self.lock = asyncio.Lock()
        self.retold = 0  # times the endpoint had to be told again

    async def __call__(self, steps_done: int, version: int) -> None:
        async with self.lock:
            self.last = (steps_done, version)
            await self._send()

    async def _send(self) -> None:
        assert self.last is not None
        try:
            out = self.tell(*self.last)
            if inspect.isawaitable(out):
                await out
        except (httpx.TransportError, LifecycleError) as e:
            if isinstance(e, LifecycleError) and (e.status_code or 500) < 500:
                raise  # a 4xx (a bad key, a step not published) is ours: stop
            logging.warning(
                "learner: could not tell the endpoint (steps_done, version) = %s (%s); "
                "telling it again once it answers",
                self.last,
                e,
            )

    async def keep(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            async with self.lock:
                if self.last is None:
                    continue
                entry = await _models(self.lifecycle)
                if entry is not None and entry.get("learner_step") != self.last[0]:
                    self.retold += 1
                    logging.warning(
                        "learner: the endpoint reports learner_step=%s, not %d (restarted?); "
                        "telling it again",
                        entry.get("learner_step"),
                        self.last[0],
                    )
                    await self._send()


async def run_learner(
    trainer,
    lifecycle: LifecycleClient,
    *,
    poll_s: float = 0.2,
    timeout_s: float | None = None,
    log: Callable[[str], Any] = logging.info,
) -> list[dict[str, Any]]:
    """The learner process's loop: once the endpoint answers, `trainer.run()`
    after publishing the starting weights of a fresh run (so the endpoint
    serves exactly the learner's weights from step 0 on). trainer: an
    RLTrainer over a StoreCollector, with `on_progress` telling the endpoint
    (`tell_endpoint(lifecycle)`)."""
    if trainer.on_progress is None:
        raise ValueError(
            "run_learner: the RLTrainer needs on_progress (e.g. "
            "tell_endpoint(LifecycleClient(endpoint, admin_key))) so the endpoint "
            "serves its weights and the collector can pace itself"
        )
    if getattr(trainer, "hand_off", None) is not None:
        raise ValueError(
            "run_learner: the RLTrainer has hand_off (the in-memory hand-off to a sampler "
            "in its own process), but this learner's endpoint is another process that "
            "reloads each step from publish_dir when on_progress tells it, before the "
            "background write of that step finished; build the RLTrainer with hand_off=None"
        )
    await wait_for_endpoint(lifecycle, poll_s=poll_s, timeout_s=timeout_s)
    if getattr(trainer, "served_weights", False) is None:  # the weights alarm's report
        trainer.served_weights = lambda: endpoint_weights(lifecycle)
    if trainer.start_step == 0:
        await asyncio.to_thread(trainer.publish)
    log(f"learner: start_step={trainer.start_step} version={trainer.version}")
    told = _ToldEndpoint(trainer.on_progress, lifecycle)
    trainer.on_progress = told
    keeper = asyncio.ensure_future(told.keep(poll_s * 5))
    try:
        history = await trainer.run()
    finally:
        keeper.cancel()
        trainer.on_progress = told.tell
    for m in history:
        log(
            f"trained rl_step={m['rl_step']} version={m['policy_version']} traces={m['traces']:.0f}"
        )
    return history
