"""Rollout lifecycle: one task attempt = one API key = one recorded Trace.

An orchestrator creates a rollout (admin key) and hands its `base_url` and
`api_key` to an unmodified harness. Every completion made with that key is
recorded into the rollout's `TraceRecorder` under an agent label; finishing
the rollout (reward, artifacts, status) writes the trace to the TraceStore
and kills the key. A rollout past its timeout is finished as `timed_out`.
Grading is the admin's: a rollout key (held by the harness, so often by the
policy) may only end its rollout as "finished" (`check_rollout_key_finish`)
and reads it without the admin's fields (`rollout_key_view`); both, and the
parsing of create/finish bodies, are in `rollout_requests`.
Ending it with its own key stops it (the key is spent: no more completions)
but does not make it final: it shows "finished" with no reward, is not stored,
and awaits the admin's finish, which grades it as usual (once). Only the
admin's finish or the server's own end (timeout, infra error) is final, and
only a final trace goes to the TraceStore, so each attempt is stored once,
graded. A key-ended rollout nobody grades is stored `timed_out` at its deadline
(never, if it has none). Otherwise a failing policy could end its rollout
early, get the admin's grade refused and be stored "finished" with no reward,
which RL drops.
All state changes happen under one lock, and a request either changes
everything it should or nothing.
"""

from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from typing import Any

from ac2_jax.serving.core.errors import APIError, bad_request
from ac2_jax.serving.core.splice import TurnMemory
from ac2_jax.serving.lifecycle.rollout_requests import check_json, check_rollout_key_finish
from ac2_jax.trace import Completion, Trace, TraceRecorder, TraceStore
from ac2_jax.trace.types import END_STATUSES

COUNTERS = (
    "aborted_completions",
    "sampler_errors",
    "server_errors",
    "malformed_tool_calls",
    "routing_not_recorded",  # MoE routing that did not cover its completion (not replayed)
    "builtin_tools_omitted",  # built-in tools (web_search, ...) left out of a prompt
)


def sampled_versions(trace: Trace) -> list[int]:
    """Every policy version that sampled a token of `trace` (per token:
    `Completion.token_versions`, so a generation that spans in-flight weight
    updates counts each), and each completion's `policy_version`, ascending."""
    return sorted(
        {
            int(v)
            for e in trace.episodes
            for c in e.completions
            for v in (c.policy_version, *c.token_versions())
        }
    )


class Rollout:
    """One task attempt: its key, trace, recorder and assistant-turn memory."""

    def __init__(self, rollout_id: str, api_key: str, trace: Trace, timeout_s: float | None):
        self.rollout_id = rollout_id
        self.api_key = api_key
        self.trace = trace
        self.recorder = TraceRecorder(trace, delta_messages=True)
        self.memory = TurnMemory()
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.deadline = None if timeout_s is None else self.started + timeout_s
        self.completions: list[dict[str, Any]] = []
        self.wall_time_s: float | None = None
        self.ended_by_key_s: float | None = None  # when its own key ended it
        self.final = False  # ended by the admin or the server: graded, stored
        # Completions that recorded nothing (the client left mid-way, the sampler failed:
        # 503, the server crashed: 500) and tool-call blocks left as text because they
        # did not parse. Shown in the status, stored in the metrics.
        self.counters = dict.fromkeys(COUNTERS, 0)
        # Labels of requests that name no agent, by system prompt (`rollout_requests.AgentRule`).
        self.agent_rules: list[Any] = []

    @property
    def ended_by_key(self) -> bool:
        return self.ended_by_key_s is not None

    @property
    def status(self) -> str:
        return self.trace.status

    @property
    def running(self) -> bool:
        return self.trace.status == "running"

    def summary(self) -> dict[str, Any]:
        """Status, completions so far, token counts and policy versions."""
        t = self.trace
        return {
            "rollout_id": self.rollout_id,
            "task_id": t.task_id,
            "attempt_id": t.attempt_id,
            "group_id": t.group_id,
            "status": t.status,
            "reward": t.reward,
            "num_completions": len(self.completions),
            "completions": list(self.completions),
            "num_episodes": len(t.episodes),
            "agents": sorted({e.agent for e in t.episodes}),
            "prompt_tokens": sum(c["prompt_tokens"] for c in self.completions),
            "completion_tokens": sum(c["completion_tokens"] for c in self.completions),
            "agent_tokens": t.num_agent_tokens,
            "policy_versions": sampled_versions(t),
            "wall_time_s": (
                self.wall_time_s
                if self.wall_time_s is not None
                else time.monotonic() - self.started
            ),
            "ended_by_key": self.ended_by_key,
            "final": self.final,
            **self.counters,
            "metadata": t.metadata,
        }


class RolloutRegistry:
    """All rollouts of one server. Thread-safe."""

    def __init__(
        self,
        trace_store: TraceStore | None = None,
        default_timeout_s: float | None = None,
        max_finished: int = 256,
        max_summaries: int = 100_000,
    ):
        self.trace_store = trace_store
        self.default_timeout_s = default_timeout_s
        self._lock = threading.RLock()  # held across store writes: take it off the loop
        self._count_lock = threading.Lock()
        self._by_id: dict[str, Rollout] = {}
        self._by_key: dict[str, Rollout] = {}
        self._dead_keys: dict[str, Rollout] = {}
        self._ungraded: dict[str, Rollout] = {}  # ended by their key, not yet final
        self._finished: collections.deque[str] = collections.deque()
        self._max_finished = max_finished
        # Evicted finished rollouts: their status without the trace (oldest dropped).
        self._summaries: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._max_summaries = max_summaries

    # -- creation and lookup

    def create(
        self,
        task_id: str,
        group_id: str | None = None,
        attempt_id: str | None = None,
        metadata: dict | None = None,
        timeout_s: float | None = None,
        agent_rules: list | None = None,
        reward_range: tuple[float, float] | None = None,
    ) -> Rollout:
        """agent_rules: `rollout_requests.AgentRule`s labelling the requests that name
        no agent by their system prompt (first match wins; kept in the trace metadata's
        `agent_rules`). reward_range: the env's (low, high); `finish` refuses a reward
        outside it (kept in the trace metadata's `reward_range`)."""
        check_json(metadata, "metadata")
        rollout_id = "ro-" + secrets.token_hex(8)
        api_key = "sk-rollout-" + secrets.token_urlsafe(24)
        trace = Trace(
            task_id=task_id,
            attempt_id=attempt_id or rollout_id,
            group_id=group_id,
            metadata=dict(metadata or {}),
        )
        trace.metadata.setdefault("rollout_id", rollout_id)
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        rollout = Rollout(rollout_id, api_key, trace, timeout)
        if reward_range is not None:
            trace.metadata["reward_range"] = [float(reward_range[0]), float(reward_range[1])]
        if agent_rules:
            rollout.agent_rules = list(agent_rules)
            trace.metadata["agent_rules"] = [
                r.model_dump(exclude_none=True) for r in rollout.agent_rules
            ]
        with self._lock:
            self._by_id[rollout_id] = rollout
            self._by_key[api_key] = rollout
        return rollout

    def get(self, rollout_id: str) -> Rollout:
        self.sweep()
        with self._lock:
            rollout = self._by_id.get(rollout_id)
        if rollout is None:
            raise self.not_found(rollout_id)
        return rollout

    @staticmethod
    def not_found(rollout_id: str) -> APIError:
        """The one 404 for an id that is missing or (to a rollout key) not its own."""
        return APIError(404, f"No rollout with id {rollout_id!r}", code="rollout_not_found")

    def evicted_summary(self, rollout_id: str) -> dict[str, Any] | None:
        """The summary of a finished rollout whose trace left memory (None if not one)."""
        with self._lock:
            return self._summaries.get(rollout_id)

    def stored_trace(self, rollout_id: str) -> dict[str, Any] | None:
        """The stored trace of an evicted rollout, by a scan of the store (slow:
        call it off the event loop); None if not evicted or not found."""
        if self.evicted_summary(rollout_id) is None or self.trace_store is None:
            return None
        for t in self.trace_store.iter_traces(on_error="skip"):
            if t.metadata.get("rollout_id") == rollout_id:
                return t.to_dict()
        return None

    def count(self, rollout: Rollout, counter: str, k: int = 1) -> None:
        """Adds `k` to one of the rollout's `COUNTERS` (never waits on a store write:
        safe on the event loop)."""
        with self._count_lock:
            rollout.counters[counter] += k

    def note_omitted_tools(self, rollout: Rollout, kinds: list[str]) -> None:
        """Built-in tools a request offered that the model was not offered (the server
        runs none): counted (`builtin_tools_omitted`, per tool per request) and named in
        the trace metadata's sorted `omitted_tools`."""
        with self._count_lock:
            rollout.counters["builtin_tools_omitted"] += len(kinds)
        with self._lock:
            named = set(rollout.trace.metadata.get("omitted_tools", ())) | set(kinds)
            rollout.trace.metadata["omitted_tools"] = sorted(named)

    def by_key(self, api_key: str) -> Rollout | None:
        """The running rollout of `api_key`; 401 if the key belonged to an ended one."""
        self.sweep()
        with self._lock:
            rollout = self._by_key.get(api_key)
            dead = self._dead_keys.get(api_key)
        if dead is not None and dead.ended_by_key:
            raise APIError(
                401,
                f"This API key ended its own rollout {dead.rollout_id}, so it "
                "no longer works: no more completions or changes with it. The "
                "admin still grades the rollout",
                code="rollout_ended_by_key",
            )
        if dead is not None:
            raise APIError(
                401,
                f"This API key belonged to rollout {dead.rollout_id}, which is "
                f"{dead.status}; its key no longer works",
                code="rollout_finished",
            )
        return rollout

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    def summary(self, rollout: Rollout) -> dict[str, Any]:
        with self._lock:  # a consistent view while completions are being recorded
            return rollout.summary()

    def trace_dict(self, rollout: Rollout) -> dict[str, Any]:
        with self._lock:
            return rollout.trace.to_dict()

    # -- recording

    def record(
        self,
        rollout: Rollout,
        agent: str,
        completions: list[Completion],
        turns: list[tuple[str | None, list[dict], list[int]]],
    ) -> list[int]:
        """Records the completions of one request and remembers its turns.

        Returns the index of the episode each completion went to. 409 if the
        rollout finished while the request ran (then nothing is recorded).
        """
        with self._lock:
            if rollout.ended_by_key and not rollout.final:
                raise APIError(
                    409,
                    f"Rollout {rollout.rollout_id} was ended by its own key; "
                    "the completion was not recorded",
                    code="rollout_ended_by_key",
                )
            if not rollout.running:
                raise APIError(
                    409,
                    f"Rollout {rollout.rollout_id} is {rollout.status}; the "
                    "completion was not recorded",
                    code="rollout_finished",
                )
            episodes = []
            for comp in completions:
                ep = rollout.recorder.record(agent, comp)
                episodes.append(next(i for i, e in enumerate(rollout.trace.episodes) if e is ep))
                rollout.completions.append(
                    {
                        "agent": agent,
                        "episode": episodes[-1],
                        "prompt_tokens": len(comp.prompt_ids),
                        "completion_tokens": len(comp.output_ids),
                        "policy_version": comp.policy_version,
                        "finish_reason": comp.finish_reason,
                    }
                )
            for content, calls, ids in turns:
                rollout.memory.remember(content, calls, ids)
            return episodes

    # -- finishing

    def finish(
        self,
        rollout: Rollout,
        status: str = "finished",
        reward: float | None = None,
        artifacts: dict | None = None,
        hints: list[str] | None = None,
        metrics: dict | None = None,
        by_rollout_key: bool = False,
    ) -> Rollout:
        """Ends the rollout for good: grades it, stores its trace and kills its key
        (409 if already final). A rollout its own key ended is graded here as usual.

        by_rollout_key: the rollout's own key ends it (only as "finished", nothing
        else set): it stops recording and its key dies, but it is neither final
        nor stored; the admin's finish (or the timeout) still ends it.
        """
        for name, value in (("artifacts", artifacts), ("metrics", metrics), ("hints", hints)):
            check_json(value, name)
        if status not in END_STATUSES:
            raise bad_request(
                f"'status' must be one of {list(END_STATUSES)}, got {status!r}", param="status"
            )
        if by_rollout_key:
            check_rollout_key_finish(
                {
                    k: v
                    for k, v in (
                        ("status", status),
                        ("reward", reward),
                        ("artifacts", artifacts),
                        ("hints", hints),
                        ("metrics", metrics),
                    )
                    if v is not None
                }
            )
            return self._end_by_key(rollout)
        span = rollout.trace.metadata.get("reward_range")
        if reward is not None and span is not None and not span[0] <= reward <= span[1]:
            raise bad_request(
                f"'reward' {reward} is outside the rollout's reward_range {span} (the env's, "
                "named at create); send a reward in it",
                param="reward",
            )
        with self._lock:
            if rollout.final:
                raise APIError(
                    409,
                    f"Rollout {rollout.rollout_id} is already {rollout.status}",
                    code="rollout_finished",
                )
            t = rollout.trace
            new_metadata = dict(t.metadata)
            if artifacts is not None:
                new_metadata["artifacts"] = artifacts
            wall = time.monotonic() - rollout.started
            new_metrics = {
                **t.metrics,
                "num_completions": len(rollout.completions),
                "num_episodes": len(t.episodes),
                "agent_tokens": t.num_agent_tokens,
                "prompt_tokens": sum(c["prompt_tokens"] for c in rollout.completions),
                "completion_tokens": sum(c["completion_tokens"] for c in rollout.completions),
                "policy_versions": sampled_versions(t),
                "wall_time_s": wall,
                **rollout.counters,
                **(metrics or {}),
            }
            if rollout.ended_by_key:
                new_metrics["ended_by_key_s"] = rollout.ended_by_key_s
            old = (t.status, t.reward, t.metadata, t.metrics, list(t.hints))
            t.status, t.reward, t.metadata, t.metrics = status, reward, new_metadata, new_metrics
            t.hints = list(t.hints) + list(hints or [])
            if self.trace_store is not None:
                try:
                    self.trace_store.append(t)
                except Exception:
                    t.status, t.reward, t.metadata, t.metrics, t.hints = old
                    raise
            rollout.wall_time_s = wall
            rollout.final = True
            self._by_key.pop(rollout.api_key, None)
            self._ungraded.pop(rollout.rollout_id, None)
            self._dead_keys[rollout.api_key] = rollout
            self._finished.append(rollout.rollout_id)
            while len(self._finished) > self._max_finished:
                self._evict(self._finished.popleft())
        return rollout

    def _evict(self, rollout_id: str) -> None:
        """Drops a finished rollout's trace from memory, keeping a small summary."""
        gone = self._by_id.pop(rollout_id, None)
        if gone is None:
            return
        self._dead_keys.pop(gone.api_key, None)
        small = gone.summary()
        small.pop("completions")
        small["evicted"] = True  # the trace is in the store
        self._summaries[rollout_id] = small
        while len(self._summaries) > self._max_summaries:
            self._summaries.popitem(last=False)

    def _end_by_key(self, rollout: Rollout) -> Rollout:
        """Stops the rollout at its key's request (see `finish`); 409 unless running."""
        with self._lock:
            if not rollout.running:
                raise APIError(
                    409,
                    f"Rollout {rollout.rollout_id} is already {rollout.status}",
                    code="rollout_finished",
                )
            rollout.trace.status = "finished"
            rollout.ended_by_key_s = time.monotonic() - rollout.started
            self._by_key.pop(rollout.api_key, None)
            self._dead_keys[rollout.api_key] = rollout
            self._ungraded[rollout.rollout_id] = rollout
        return rollout

    def sweep(self, now: float | None = None) -> list[Rollout]:
        """Finishes every rollout that is not final (running, or ended by its key and
        not graded) past its deadline as `timed_out`."""
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [
                r
                for r in (*self._by_key.values(), *self._ungraded.values())
                if r.deadline is not None and now >= r.deadline
            ]
            for r in late:
                if not r.final:
                    try:
                        self.finish(r, status="timed_out")
                    except Exception:  # noqa: BLE001 - a store failure must not break requests
                        logging.exception("could not store timed-out rollout %s", r.rollout_id)
        return late
