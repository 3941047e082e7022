"""The tool loop, and the harness shapes built on it.

DefaultOrchestrator: completions + tool calls answered by the env's tools,
until an answer message, within step and token limits.
CompactionOrchestrator: past a context budget, a compactor agent writes a
memo and the main agent restarts from task + memo (a new episode).
SubagentOrchestrator: a `spawn_subagent` tool runs a labelled subagent.
MultiResponseOrchestrator: n responses per request, one branch continues.
Transient messages: shown for one request, never kept in history.
"""

from __future__ import annotations

from typing import Any, Callable

from ac2_jax.envs.base import Task, Tool, run_tool
from ac2_jax.orchestration.base import Orchestrator, SingleTaskUser, run_task


def _assistant_message(msg) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
    if msg.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name,
                                           "arguments": c.function.arguments}}
                             for c in msg.tool_calls]
    return out


class DefaultOrchestrator(Orchestrator):
    """Tool loop. `transient(step, messages)` may add messages for one request only."""

    agent = "main"
    n = 1  # responses per request

    def __init__(self, *args, transient: Callable[[int, list], list | None] | None = None, **kw):
        super().__init__(*args, **kw)
        self.transient = transient

    @property
    def tools(self) -> list[Tool]:
        return self.env.tools

    async def call_tool(self, name: str, arguments: str) -> tuple[str, bool]:
        tool = next((t for t in self.tools if t.name == name), None)
        if tool is None:
            return f"error: unknown tool {name!r}", False
        return await run_tool(tool, arguments)

    def choose(self, choices) -> Any:
        """Which of the n choices continues the conversation (the first)."""
        return choices[0]

    async def step(self, messages: list[dict]) -> Any:
        """One request: returns the chosen choice's message."""
        extra = self.transient(self.trace.metrics["steps"], messages) if self.transient else None
        request = messages + list(extra or [])
        resp = await self.complete(request, agent=self.agent, n=self.n,
                                   tools=[t.spec() for t in self.tools] or None)
        self.trace.metrics["steps"] += 1
        return self.choose(resp.choices).message

    async def run(self, turn_input: str) -> None:
        msgs = self.trace.messages
        msgs.append({"role": "user", "content": turn_input})
        self.trace.status = "running"
        while True:
            if self.trace.metrics["steps"] >= self.max_steps:
                self.trace.status = "step_limit"
                return
            used = self.trace.metrics["prompt_tokens"] + self.trace.metrics["output_tokens"]
            if used >= self.max_total_tokens:
                self.trace.status = "token_limit"
                return
            msg = await self.step(msgs)
            msgs.append(_assistant_message(msg))
            if not msg.tool_calls:
                self.trace.answer = msg.content
                self.trace.status = "finished"
                await self.after_turn()
                return
            for call in msg.tool_calls:
                text, ok = await self.call_tool(call.function.name, call.function.arguments)
                self.trace.metrics["tool_calls"] += 1
                self.trace.metrics["tool_errors"] += 0 if ok else 1
                msgs.append({"role": "tool", "tool_call_id": call.id, "content": text})
            await self.after_turn()

    async def after_turn(self) -> None:
        """Hook run after each model turn (compaction lives here)."""


class CompactionOrchestrator(DefaultOrchestrator):
    """Compacts the history into a memo when the context passes `context_budget` tokens."""

    COMPACT_PROMPT = "Summarize the progress so far in one short memo."

    def __init__(self, *args, context_budget: int = 256, **kw):
        super().__init__(*args, **kw)
        self.context_budget = context_budget
        self._last_context = 0
        self.compactions = 0

    async def complete(self, messages, **kw):
        resp = await super().complete(messages, **kw)
        if resp.usage is not None:
            self._last_context = resp.usage.prompt_tokens + resp.usage.completion_tokens
        return resp

    async def after_turn(self) -> None:
        if self._last_context <= self.context_budget or self.trace.status == "finished":
            return
        msgs = self.trace.messages
        request = msgs + [{"role": "user", "content": self.COMPACT_PROMPT}]
        resp = await self.complete(request, agent="compactor")
        memo = resp.choices[0].message.content or ""
        self.compactions += 1
        self.trace.events.append({"agent": "compactor", "kind": "compaction", "memo": memo})
        head = [m for m in msgs[:1] if m["role"] == "system"]
        self.trace.messages[:] = head + [{
            "role": "user", "content": f"{self.trace.task.prompt}\n\nProgress so far: {memo}"}]
        self._last_context = 0


class SubagentOrchestrator(DefaultOrchestrator):
    """Adds a `spawn_subagent(name, task)` tool; the subagent's answer is the result."""

    def __init__(self, *args, subagent_max_steps: int = 4, **kw):
        super().__init__(*args, **kw)
        self.subagent_max_steps = subagent_max_steps
        self.subagents: list[str] = []

    @property
    def tools(self) -> list[Tool]:
        spawn = Tool(
            name="spawn_subagent",
            description="Run a helper agent on a sub-task; returns its answer.",
            parameters={"type": "object", "properties": {
                "name": {"type": "string"}, "task": {"type": "string"}},
                "required": ["name", "task"]},
            fn=self._spawn, timeout_s=300.0)
        return self.env.tools + [spawn]

    async def _spawn(self, name: str, task: str) -> str:
        sub_task = Task(task_id=f"{self.trace.task.task_id}/{name}", prompt=task)
        sub = DefaultOrchestrator(self.env, sub_task, self.client, self.model,
                                  max_steps=self.subagent_max_steps, sampling=self.sampling)
        sub.agent = f"subagent:{name}"
        self.subagents.append(name)
        result = await run_task(sub, SingleTaskUser())
        for k in ("steps", "tool_calls", "tool_errors", "prompt_tokens", "output_tokens",
                  "cached_tokens"):
            self.trace.metrics[k] += result.metrics[k]
        return result.answer or f"(subagent {name} gave no answer: {result.status})"


class MultiResponseOrchestrator(DefaultOrchestrator):
    """Asks for `n` responses per request; each is its own episode branch."""

    def __init__(self, *args, n: int = 2, **kw):
        super().__init__(*args, **kw)
        self.n = n
        self.collected: list[list[str | None]] = []

    def choose(self, choices):
        self.collected.append([c.message.content for c in choices])
        return super().choose(choices)
