"""The tool loop, and the harness shapes built on it.

DefaultOrchestrator: completions + tool calls answered by the env's tools,
until an answer message, within step and token limits.
CompactionOrchestrator: past a context budget, a compactor agent writes a
memo and the main agent restarts from memo + current turn + latest tool exchange.
SubagentOrchestrator: a `spawn_subagent` tool runs a labelled subagent.
MultiResponseOrchestrator: n responses per request, one branch continues.
Transient messages: shown for one request, never kept in history.

Malformed tool calls. The endpoint (ac2_jax/serving/core/chat.py, via
the tokenizer's parser from ac2_jax.text.tool_parsers) turns each well-formed
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
from collections.abc import Callable
from typing import Any

from ac2_jax.envs.base import Task, Tool, run_tool
from ac2_jax.orchestration.base import Orchestrator, SingleTaskUser, run_task


def _assistant_message(msg) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
    if msg.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": c.function.arguments},
            }
            for c in msg.tool_calls
        ]
    return out


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def tool_format_error(content: str | None, finish_reason: str | None) -> str | None:
    """What is wrong with a `<tool_call>` block left in the content (None: nothing left)."""
    content = content or ""
    start = content.find(TOOL_CALL_OPEN)
    if start < 0:
        return None
    rest = content[start + len(TOOL_CALL_OPEN) :]
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
    return {
        "role": "user",
        "content": (
            f"error: your tool call was not run: {why}. Write each call as "
            '<tool_call>{"name": "...", "arguments": {...}}</tool_call> with valid JSON, '
            "or answer without a tool call when done."
        ),
    }


class DefaultOrchestrator(Orchestrator):
    """Tool loop. `transient(step, messages)` may add messages for one request only."""

    agent = "main"
    n = 1  # responses per request

    def __init__(self, *args, transient: Callable[[int, list], list | None] | None = None, **kw):
        super().__init__(*args, **kw)
        self.transient = transient
        self.last_finish_reason: str | None = None
        self.last_response_id: str | None = None  # the latest response's id (endpoint's)

    @property
    def tools(self) -> list[Tool]:
        return self.env.tools

    async def call_tool(self, name: str, arguments: str) -> tuple[str, bool]:
        tool = next((t for t in self.tools if t.name == name), None)
        if tool is None:
            return f"error: unknown tool {name!r}", False
        return await run_tool(tool, arguments, task=self.trace.task)

    def choose(self, choices) -> Any:
        """Which of the n choices continues the conversation (the first)."""
        return choices[0]

    async def step(self, messages: list[dict]) -> Any:
        """One request: returns the chosen choice's message."""
        step = self.trace.steps_of(self.agent)
        extra = self.transient(step, messages) if self.transient else None
        request = messages + list(extra or [])
        resp = await self.complete(
            request, agent=self.agent, n=self.n, tools=[t.spec() for t in self.tools] or None
        )
        self.trace.count_step(self.agent)
        self.last_response_id = getattr(resp, "id", None)  # what choose() records
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
            if not await self.before_step():
                return  # the hook ended the attempt (it set trace.status)
            msg = await self.step(msgs)
            msgs.append(_assistant_message(msg))
            if (
                self.max_context_tokens is not None
                and self.last_context is not None
                and self.last_context > self.max_context_tokens
            ):
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

    async def before_step(self) -> bool:
        """Hook run before each request of this agent (compaction lives here); False ends."""
        return True

    async def after_turn(self) -> None:
        """Hook run after each model turn."""


class CompactionOrchestrator(DefaultOrchestrator):
    """Compacts the history into a memo when the next main request would pass `context_budget`.

    Checked before each main request, so at turn boundaries (a new user turn)
    and mid-turn (after tool results): the estimate is the latest main
    request's prompt + output plus ~len/4 tokens of messages added since (plus
    `message_overhead_tokens` per message for the chat template's markers). The
    compactor is its own agent ("compactor", own system prompt) and sees the
    history as a transcript. The main agent restarts (a new episode) from its
    system prompt, the memo, the current turn's user input and the latest tool
    exchange, all verbatim, so it always sees the latest tool result; with
    `keep_exchange=False` it restarts from system prompt, turn input and memo
    (in that order) only, so whatever it needs from the work so far must be in the memo (the
    long-horizon main job: the memo then decides the outcome). Each
    "compaction" event carries the memo and, when the env can judge it
    (`Env.judge_memo` on the history the memo replaces), `memo_ok`. The next
    main request's prompt must be smaller than the context it replaces (the
    estimate that triggered compaction); after `max_consecutive_compactions`
    compactions without a main prompt under the budget (or at once when one did
    not shrink), the attempt ends as agent_error with the reason in a
    "compaction_error" event. `memo_prefix` starts the memo's message ("Progress
    so far: "); `compactor_sampling` overrides `sampling` for the compactor's
    requests (a summarizer sampled at its own temperature). Prompts, not prompt +
    output, are compared, so an
    agent that makes one tool call per episode (the long-horizon main job: a
    compaction after every tool result) is not penalized for its own output.
    """

    COMPACTOR_SYSTEM_PROMPT = (
        "You are a compactor. You are shown the transcript of an agent working on a task. "
        "Write one short memo of the progress so far: what was asked, what was done, "
        "results obtained, and what remains. Reply with the memo only."
    )
    COMPACT_PROMPT = "Summarize the progress so far in one short memo."

    def __init__(
        self,
        *args,
        context_budget: int = 256,
        max_consecutive_compactions: int = 2,
        keep_exchange: bool = True,
        message_overhead_tokens: int = 0,
        memo_prefix: str = "Progress so far: ",
        compactor_sampling: dict | None = None,
        **kw,
    ):
        super().__init__(*args, **kw)
        self.context_budget = context_budget
        # The memo reaches the main agent as a user message `memo_prefix + memo`.
        self.memo_prefix = memo_prefix
        # Sampling overrides for the compactor's requests (e.g. its own temperature),
        # on top of `sampling`; keys as in `sampling`.
        self.compactor_sampling = dict(compactor_sampling or {})
        # Tokens a chat template adds around each message (role markers, tool-response
        # tags): a 3-character tool result costs ~15 tokens, not len/4 = 0.
        self.message_overhead_tokens = message_overhead_tokens
        self.keep_exchange = keep_exchange
        self.max_consecutive_compactions = max_consecutive_compactions
        self.compactions = 0
        self._consecutive = 0
        self._main_context: int | None = None  # prompt + output of the latest main request
        self._seen = 0  # len(messages) when that request was answered
        self._before_compaction: int | None = None
        self._turn_input: str | None = None
        self._pending: str | None = None  # a failed shrink check, ends before the next request

    async def run(self, turn_input: str) -> None:
        self._turn_input = turn_input
        await super().run(turn_input)

    async def step(self, messages):
        msg = await super().step(messages)
        # The request's prompt is what compaction shrinks: it must be smaller than the
        # context it replaces (the estimate that triggered compaction) and a prompt
        # under the budget ends a run of consecutive compactions.
        prompt = self.last_prompt
        if prompt is not None:
            if self._before_compaction is not None:
                if prompt >= self._before_compaction:
                    self._pending = (
                        f"compaction did not shrink the context ({prompt} "
                        f"prompt tokens after, {self._before_compaction} before)"
                    )
                self._before_compaction = None
            if prompt <= self.context_budget:
                self._consecutive = 0
        self._main_context = self.last_context
        self._seen = len(messages) + 1  # + the answer about to be appended
        return msg

    def _fail(self, reason: str) -> None:
        self.trace.status = "agent_error"
        self.trace.events.append(
            {"agent": "compactor", "kind": "compaction_error", "reason": reason}
        )

    def _estimate(self) -> int:
        if self._main_context is None:
            return 0
        added = self.trace.messages[self._seen :]
        return self._main_context + sum(
            len(m.get("content") or "") // 4 + self.message_overhead_tokens for m in added
        )

    def _kept(self) -> tuple[list[dict], list[dict]]:
        """(the current turn's user message, the latest tool exchange), both verbatim."""
        msgs = self.trace.messages
        turn_i = next(
            (
                i
                for i in range(len(msgs) - 1, -1, -1)
                if msgs[i]["role"] == "user" and msgs[i].get("content") == self._turn_input
            ),
            None,
        )
        turn = [msgs[turn_i]] if turn_i is not None else []
        start = len(msgs)
        while start > 0 and (
            msgs[start - 1]["role"] == "tool"
            or (
                msgs[start - 1]["role"] == "user"
                and (msgs[start - 1].get("content") or "").startswith("error:")
            )
        ):
            start -= 1
        exchange = []
        if (
            start < len(msgs)
            and start > 0
            and msgs[start - 1]["role"] == "assistant"
            and msgs[start - 1].get("tool_calls")
            and (turn_i is None or start - 1 > turn_i)
        ):
            exchange = msgs[start - 1 :]
        return turn, exchange

    def _transcript(self) -> str:
        lines = []
        for m in self.trace.messages:
            if m["role"] == "system":
                continue
            text = m.get("content") or ""
            for c in m.get("tool_calls") or []:
                text += f"\n[call {c['function']['name']}({c['function']['arguments']})]"
            lines.append(f"{m['role']}: {text.strip()}")
        return "\n".join(lines)

    async def before_step(self) -> bool:
        if self._pending is not None:
            self._fail(self._pending)
            return False
        if self._estimate() <= self.context_budget:
            return True
        if self._consecutive >= self.max_consecutive_compactions:
            self._fail(
                f"context still over the budget ({self._estimate()} > "
                f"{self.context_budget} tokens) after {self._consecutive} consecutive "
                "compactions"
            )
            return False
        before = self._estimate()
        request = [
            {"role": "system", "content": self.COMPACTOR_SYSTEM_PROMPT},
            {"role": "user", "content": f"{self._transcript()}\n\n{self.COMPACT_PROMPT}"},
        ]
        resp = await self.complete(request, agent="compactor", **self.compactor_sampling)
        self.trace.count_step("compactor")
        memo = resp.choices[0].message.content or ""
        self.compactions += 1
        self._consecutive += 1
        event = {"agent": "compactor", "kind": "compaction", "memo": memo}
        msgs = self.trace.messages
        judge = getattr(self.env, "judge_memo", None)
        judged = judge(self.trace.task, list(msgs), memo) if judge is not None else None
        if judged is not None:
            event["memo_ok"] = bool(judged)
        self.trace.events.append(event)
        head = [m for m in msgs[:1] if m["role"] == "system"]
        turn, exchange = self._kept()
        progress = [{"role": "user", "content": f"{self.memo_prefix}{memo}"}]
        if self.keep_exchange:
            msgs[:] = head + progress + turn + exchange
        else:  # the memo is the latest state: it comes last, right before the agent's turn
            msgs[:] = head + turn + progress
        self._before_compaction = before
        self._main_context, self._seen = None, len(msgs)
        return True


class SubagentOrchestrator(DefaultOrchestrator):
    """Adds a `spawn_subagent(name, task)` tool; the subagent's answer is the result."""

    def __init__(self, *args, subagent_max_steps: int | None = None, **kw):
        super().__init__(*args, **kw)
        # Each subagent has its own step budget (default: the main agent's).
        self.subagent_max_steps = (
            self.max_steps if subagent_max_steps is None else subagent_max_steps
        )
        self.subagents: list[str] = []

    @property
    def tools(self) -> list[Tool]:
        spawn = Tool(
            name="spawn_subagent",
            description="Run a helper agent on a sub-task; returns its answer.",
            parameters={
                "type": "object",
                "properties": {"name": {"type": "string"}, "task": {"type": "string"}},
                "required": ["name", "task"],
            },
            fn=self._spawn,
            timeout_s=300.0,
        )
        return self.env.tools + [spawn]

    async def _spawn(self, name: str, task: str) -> str:
        sub_task = Task(task_id=f"{self.trace.task.task_id}/{name}", prompt=task)
        generated_left = (
            None
            if self.max_generated_tokens is None
            else max(0, self.max_generated_tokens - self.trace.metrics["output_tokens"])
        )
        sub = DefaultOrchestrator(
            self.env,
            sub_task,
            self.client,
            self.model,
            max_steps=self.subagent_max_steps,
            sampling=self.sampling,
            max_context_tokens=self.max_context_tokens,
            max_generated_tokens=generated_left,
        )
        sub.agent = f"subagent:{name}"
        sub.seed_scope = f"{self.seed_scope}/spawn{len(self.subagents)}"  # its own seeds
        self.subagents.append(name)
        result = await run_task(sub, SingleTaskUser())
        m = self.trace.metrics
        for k in (
            "tool_calls",
            "tool_errors",
            "tool_format_errors",
            "prompt_tokens",
            "output_tokens",
            "cached_tokens",
        ):
            m[k] += result.metrics[k]
        m["max_context_tokens"] = max(m["max_context_tokens"], result.metrics["max_context_tokens"])
        for agent, n in result.metrics["steps_by_agent"].items():
            self.trace.count_step(agent, n)  # the total and the subagent's own count
        return result.answer or f"(subagent {name} gave no answer: {result.status})"


class MultiResponseOrchestrator(DefaultOrchestrator):
    """Asks for `n` responses per request; each is its own episode branch.

    `select` picks the branch that continues: "first" (choice 0), "verify"
    (best-of-n by the env's verifier on each response's text), or a callable
    text -> score (best-of-n; ties go to the lowest index). Each request's choice
    is kept in `trace.metrics["branch_choices"]` as {"request_id": the response's
    id, "index": the chosen index}, so the rollout's artifacts say which
    response was continued (run_rollout stores them whatever the status); RL
    training (`ac2_jax.training.rl.branches`) trains the continued path only,
    so the other responses never get its reward.
    """

    def __init__(
        self, *args, n: int = 2, select: str | Callable[[str | None], float] = "first", **kw
    ):
        super().__init__(*args, **kw)
        if not (callable(select) or select in ("first", "verify")):
            raise ValueError(
                f"MultiResponseOrchestrator: select must be 'first', 'verify' or a "
                f"callable, got {select!r}"
            )
        self.n = n
        self.select = select
        self.collected: list[list[str | None]] = []

    def score(self, text: str | None) -> float:
        select = self.select
        if select == "verify":
            return float(self.env.verify(self.trace.task, text))
        if not callable(select):  # "first" keeps choice 0 and scores nothing
            raise TypeError(f"MultiResponseOrchestrator.score: select={select!r} gives no score")
        return float(select(text))

    def choose(self, choices):
        texts = [c.message.content for c in choices]
        self.collected.append(texts)
        index = 0
        if self.select != "first" and len(choices) > 1:
            scores = [self.score(t) for t in texts]
            index = max(range(len(scores)), key=lambda i: (scores[i], -i))
        self.trace.metrics.setdefault("branch_choices", []).append(
            {"request_id": self.last_response_id, "index": index}
        )
        return choices[index]
