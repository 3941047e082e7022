"""The tool loop, and the harness shapes built on it.

DefaultOrchestrator: completions + tool calls answered by the env's tools,
until an answer message, within step and token limits.
CompactionOrchestrator: past a context budget, a compactor agent writes a
memo and the main agent restarts from task + memo (a new episode).
SubagentOrchestrator: a `spawn_subagent` tool runs a labelled subagent.
MultiResponseOrchestrator: n responses per request, one branch continues.
Transient messages: shown for one request, never kept in history.

Malformed tool calls. The endpoint (ac2_jax/serving/chat.py, via
models.tokenizer.parse_tool_calls) turns each well-formed
`<tool_call>{"name", "arguments"}</tool_call>` block into a message.tool_calls
entry and leaves malformed blocks (unparsable JSON, no "name", or no closing
tag because the output was cut at max_tokens, finish_reason "length") in
message.content as text. So the orchestrator detects them as a `<tool_call>`
left in the content: it answers with a user message starting "error:" that
says what was wrong (there is no tool_call_id to answer as a tool message),
counts metrics["tool_format_errors"], and goes on (bounded by max_steps).
Well-formed calls in the same message still run. A call whose arguments are
bad JSON but whose block parsed (e.g. from another server) reaches the tool
and is a tool error (run_tool). A "length" finish with no `<tool_call>` is
a (truncated) answer.
"""

from __future__ import annotations

import json
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


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def tool_format_error(content: str | None, finish_reason: str | None) -> str | None:
    """What is wrong with a `<tool_call>` block left in the content (None: nothing left)."""
    content = content or ""
    start = content.find(TOOL_CALL_OPEN)
    if start < 0:
        return None
    rest = content[start + len(TOOL_CALL_OPEN):]
    end = rest.find(TOOL_CALL_CLOSE)
    if end < 0:
        why = "the tool call was truncated (no closing </tool_call>"
        return why + (", the output hit max_tokens)" if finish_reason == "length" else ")")
    try:
        obj = json.loads(rest[:end].strip())
    except json.JSONDecodeError as e:
        return f"the tool call's JSON could not be parsed ({e})"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return 'the tool call JSON needs a "name" string and an "arguments" object'
    return "the tool call could not be parsed"


def format_error_message(why: str) -> dict[str, str]:
    return {"role": "user", "content": (
        f"error: your tool call was not run: {why}. Write each call as "
        '<tool_call>{"name": "...", "arguments": {...}}</tool_call> with valid JSON, '
        "or answer without a tool call when done.")}


class DefaultOrchestrator(Orchestrator):
    """Tool loop. `transient(step, messages)` may add messages for one request only."""

    agent = "main"
    n = 1  # responses per request

    def __init__(self, *args, transient: Callable[[int, list], list | None] | None = None, **kw):
        super().__init__(*args, **kw)
        self.transient = transient
        self.last_finish_reason: str | None = None

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
        step = self.trace.steps_of(self.agent)
        extra = self.transient(step, messages) if self.transient else None
        request = messages + list(extra or [])
        resp = await self.complete(request, agent=self.agent, n=self.n,
                                   tools=[t.spec() for t in self.tools] or None)
        self.trace.count_step(self.agent)
        choice = self.choose(resp.choices)
        self.last_finish_reason = getattr(choice, "finish_reason", None)
        return choice.message

    async def run(self, turn_input: str) -> None:
        msgs = self.trace.messages
        msgs.append({"role": "user", "content": turn_input})
        self.trace.status = "running"
        while True:
            if self.trace.steps_of(self.agent) >= self.max_steps:
                self.trace.status = "step_limit"
                return
            if self.over_token_budget():
                self.trace.status = "token_limit"
                return
            msg = await self.step(msgs)
            msgs.append(_assistant_message(msg))
            if (self.max_context_tokens is not None and self.last_context is not None
                    and self.last_context > self.max_context_tokens):
                self.trace.status = "token_limit"  # checked per request
                return
            format_error = tool_format_error(msg.content, self.last_finish_reason)
            if format_error is not None and not msg.tool_calls:
                self.trace.metrics["tool_format_errors"] += 1
                msgs.append(format_error_message(format_error))
                await self.after_turn()
                continue
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
            if format_error is not None:  # well-formed calls ran; a malformed one did not
                self.trace.metrics["tool_format_errors"] += 1
                msgs.append(format_error_message(format_error))
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

    def __init__(self, *args, subagent_max_steps: int | None = None, **kw):
        super().__init__(*args, **kw)
        # Each subagent has its own step budget (default: the main agent's).
        self.subagent_max_steps = self.max_steps if subagent_max_steps is None else subagent_max_steps
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
        generated_left = (None if self.max_generated_tokens is None else
                          max(0, self.max_generated_tokens - self.trace.metrics["output_tokens"]))
        sub = DefaultOrchestrator(self.env, sub_task, self.client, self.model,
                                  max_steps=self.subagent_max_steps, sampling=self.sampling,
                                  max_context_tokens=self.max_context_tokens,
                                  max_generated_tokens=generated_left)
        sub.agent = f"subagent:{name}"
        self.subagents.append(name)
        result = await run_task(sub, SingleTaskUser())
        m = self.trace.metrics
        for k in ("tool_calls", "tool_errors", "tool_format_errors", "prompt_tokens",
                  "output_tokens", "cached_tokens"):
            m[k] += result.metrics[k]
        m["max_context_tokens"] = max(m["max_context_tokens"], result.metrics["max_context_tokens"])
        for agent, n in result.metrics["steps_by_agent"].items():
            self.trace.count_step(agent, n)  # the total and the subagent's own count
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
