"""The general loop: a User and an Orchestrator, talking through an OpenAI client.

    turn_input = await user.respond(orchestrator.env, orchestrator.trace)
    while turn_input is not None:
        await orchestrator.run(turn_input)
        turn_input = await user.respond(orchestrator.env, orchestrator.trace)

Orchestrators reach the model only through an OpenAI-compatible client (in
training: the endpoint with a rollout's key), so the production code path is
the training one. Token-level episodes are recorded by the endpoint; the
orchestrator keeps the conversation as it saw it (`ConversationTrace`) and
its process metrics.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from typing import Any

from ac2_jax.envs.base import Env, Task
from ac2_jax.seeds import request_seed

AGENT_HEADER = "X-Agent"


@dataclasses.dataclass
class ConversationTrace:
    """What an orchestrator saw: its main history, the answer, and metrics."""

    task: Task
    messages: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    answer: str | None = None
    # running | finished | step_limit | token_limit | agent_error | infra_error
    status: str = "running"
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # steps: requests of all agents; steps_by_agent: per agent label.
    # max_context_tokens: the largest prompt + output of any single request.
    # tool_format_errors: malformed or truncated tool calls answered with an error.
    metrics: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {
            "steps": 0,
            "steps_by_agent": {},
            "tool_calls": 0,
            "tool_errors": 0,
            "tool_format_errors": 0,
            "prompt_tokens": 0,
            "output_tokens": 0,
            "cached_tokens": 0,
            "max_context_tokens": 0,
            "wall_time_s": 0.0,
        }
    )

    def count_step(self, agent: str, n: int = 1) -> None:
        self.metrics["steps"] += n
        by = self.metrics["steps_by_agent"]
        by[agent] = by.get(agent, 0) + n

    def steps_of(self, agent: str) -> int:
        return self.metrics["steps_by_agent"].get(agent, 0)

    def count_usage(self, usage) -> int | None:
        """Adds one request's usage; returns its context (prompt + output) or None."""
        if usage is None:
            return None
        context = (usage.prompt_tokens or 0) + (usage.completion_tokens or 0)
        self.metrics["max_context_tokens"] = max(self.metrics["max_context_tokens"], context)
        self.metrics["prompt_tokens"] += usage.prompt_tokens or 0
        self.metrics["output_tokens"] += usage.completion_tokens or 0
        details = getattr(usage, "prompt_tokens_details", None)
        self.metrics["cached_tokens"] += (
            (getattr(details, "cached_tokens", 0) or 0) if details else 0
        )
        return context


class Orchestrator(abc.ABC):
    """Runs turns of one task against a model client. Subclasses shape the harness.

    Budgets: `max_steps` counts this orchestrator's own agent's requests only
    (subagents get their own budget); `max_context_tokens` bounds the
    prompt + output of each single request; `max_generated_tokens` bounds the
    output tokens of all requests together (None: unbounded).
    """

    def __init__(
        self,
        env: Env,
        task: Task,
        client,
        model: str,
        *,
        max_steps: int = 8,
        max_context_tokens: int | None = 100_000,
        max_generated_tokens: int | None = None,
        sampling: dict[str, Any] | None = None,
        **kw,
    ):
        if "max_total_tokens" in kw:
            raise TypeError(
                "max_total_tokens was removed (it summed prompt tokens over requests): use "
                "max_context_tokens (bound on prompt + output of each request) and/or "
                "max_generated_tokens (bound on output tokens of all requests together)"
            )
        if kw:
            raise TypeError(f"unexpected keyword arguments: {sorted(kw)}")
        self.env = env
        self.client = client  # openai.AsyncOpenAI (or compatible)
        self.model = model
        self.max_steps = max_steps
        self.max_context_tokens = max_context_tokens
        self.max_generated_tokens = max_generated_tokens
        self.last_context: int | None = None  # prompt + output of the latest request
        self.last_prompt: int | None = None  # prompt tokens of the latest request
        self.sampling = dict(sampling or {})
        # A "seed" in `sampling` seeds the attempt; each request gets its own
        # (`request_seed`): the request count and this orchestrator's scope in
        # the attempt ("" at the top, set by a parent for its subagents).
        self.seed_scope = ""
        self.requests_sent = 0
        self.trace = ConversationTrace(task=task, messages=list(env.initial_messages(task)[:-1]))

    @abc.abstractmethod
    async def run(self, turn_input: str) -> None:
        """Handles one user turn (until the agent answers or a limit hits)."""

    def over_token_budget(self) -> bool:
        """Whether the latest request passed the context bound, or all output the generated one."""
        if (
            self.max_context_tokens is not None
            and self.last_context is not None
            and self.last_context > self.max_context_tokens
        ):
            return True
        return (
            self.max_generated_tokens is not None
            and self.trace.metrics["output_tokens"] >= self.max_generated_tokens
        )

    async def complete(self, messages, *, agent: str = "main", tools=None, n: int = 1, **kw):
        """One chat completion request, labelled with the agent's name."""
        params = {**self.sampling, **kw}
        if params.get("seed") is not None:
            params["seed"] = request_seed(params["seed"], self.seed_scope, self.requests_sent)
        self.requests_sent += 1
        if tools:
            params["tools"] = tools
        if n != 1:
            params["n"] = n
        t0 = time.perf_counter()
        resp = await self.client.chat.completions.create(
            model=self.model, messages=messages, extra_headers={AGENT_HEADER: agent}, **params
        )
        self.last_context = self.trace.count_usage(resp.usage)
        self.last_prompt = getattr(resp.usage, "prompt_tokens", None)
        self.trace.events.append(
            {"agent": agent, "kind": "completion", "latency_s": time.perf_counter() - t0}
        )
        return resp


class User(abc.ABC):
    """Decides the next turn input from the env and what happened so far."""

    @abc.abstractmethod
    async def respond(self, env: Env, trace: ConversationTrace) -> str | None:
        """The next user message, or None to end the task."""


class SingleTaskUser(User):
    """Asks the task once; ends after the agent's answer (or a limit)."""

    def __init__(self):
        self._asked = False

    async def respond(self, env, trace):
        if self._asked:
            return None
        self._asked = True
        return trace.task.prompt


class EnvUser(SingleTaskUser):
    """Asks the task, then lets the env answer each reply of the agent: a multi-turn env
    has `reply(task, messages)` -> its next user message, or None to end (envs/contract.py).
    An env without `reply`, or an attempt that ended other than by an answer (a step or
    token limit), ends after that turn, as with SingleTaskUser. `reply` sees the
    conversation as the harness keeps it (`trace.messages`: after a compaction, the
    compacted context), so an env that counts turns should count them in the task's
    own terms where a compacting harness runs it."""

    async def respond(self, env, trace):
        if not self._asked:
            return await super().respond(env, trace)
        reply = getattr(env, "reply", None)
        if reply is None or trace.status != "finished":
            return None
        return reply(trace.task, list(trace.messages))


class ScriptedUser(User):
    """Says the given messages in order, one per turn, then ends."""

    def __init__(self, messages: list[str]):
        self._messages = list(messages)

    async def respond(self, env, trace):
        if trace.status not in ("running", "finished") or not self._messages:
            return None
        return self._messages.pop(0)


async def run_task(orchestrator: Orchestrator, user: User) -> ConversationTrace:
    """The general loop. Returns the orchestrator's trace with wall time."""
    t0 = time.perf_counter()
    try:
        turn_input = await user.respond(orchestrator.env, orchestrator.trace)
        while turn_input is not None:
            await orchestrator.run(turn_input)
            turn_input = await user.respond(orchestrator.env, orchestrator.trace)
    finally:
        orchestrator.trace.metrics["wall_time_s"] = time.perf_counter() - t0
    return orchestrator.trace
