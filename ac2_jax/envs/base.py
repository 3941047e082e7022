"""The environment interface: tasks, tools, and a verifier that gives a reward.

An `Env` is what an orchestrator works in and what RL samples from. Tools run
with a timeout, and any tool failure comes back as text for the model (a tool
message), never as an exception in the loop.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import inspect
import json
import os
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ac2_jax.envs.sandbox import SandboxLimits, check_sandboxable, run_sandboxed

# Sync tools run on this bounded pool, never on the event loop's default
# executor: a timed-out sync tool's thread cannot be stopped and keeps running,
# and on the default executor it would hold a thread that asyncio.to_thread
# (e.g. RLTrainer.update) needs. Size: AC2_TOOL_THREADS or set_tool_threads().
_TOOL_THREADS = int(os.environ.get("AC2_TOOL_THREADS", "32"))
_tool_pool: ThreadPoolExecutor | None = None
_tool_pool_lock = threading.Lock()


def set_tool_threads(n: int) -> None:
    """Sets the size of the sync-tool thread pool (takes effect for a new pool)."""
    global _TOOL_THREADS, _tool_pool
    if n < 1:
        raise ValueError(f"set_tool_threads: need at least 1 thread, got {n}")
    with _tool_pool_lock:
        _TOOL_THREADS = n
        old, _tool_pool = _tool_pool, None
    if old is not None:
        old.shutdown(wait=False)


def tool_executor() -> ThreadPoolExecutor:
    """The bounded pool sync tools run on (hung tools only ever fill this one)."""
    global _tool_pool
    with _tool_pool_lock:
        if _tool_pool is None:
            _tool_pool = ThreadPoolExecutor(_TOOL_THREADS, thread_name_prefix="ac2-tool")
        return _tool_pool


class AgentError(Exception):
    """The agent's own fault, e.g. a reply a harness or verifier cannot use.

    Raised by a harness (orchestrator) or `Env.verify`, it ends the rollout
    as `agent_error`, which is trained. Any other exception during a rollout
    ends it as `infra_error` (our fault), which never is.
    """


@dataclasses.dataclass
class Task:
    """One task: what the user asks, and what the verifier checks against."""

    task_id: str
    prompt: str
    answer: Any = None
    domain: str = "default"
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Tool:
    """A function the model may call, with its OpenAI JSON schema.

    `fn(**arguments)` gets the model's arguments. A `fn` with a parameter named
    `task` that its `parameters` schema does not list (so the model never sends it)
    also gets the attempt's `Task`, for per-task tool state (a per-task database, a
    file tree) without module globals: `def query(sql, task): return
    DBS[task.task_id].execute(sql)`. A sandboxed tool gets it pickled. (A schema
    that lists "task" makes it the model's argument, as `spawn_subagent`'s is.)
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any] | Callable[..., Awaitable[Any]]
    timeout_s: float = 10.0
    # Run each call in a fresh limited child process (envs/sandbox.py); fn must pickle.
    sandbox: SandboxLimits | None = None

    def __post_init__(self):
        if self.sandbox is not None:
            check_sandboxable(self.name, self.fn)

    @property
    def takes_task(self) -> bool:
        """Whether `fn` gets the attempt's Task: it has a parameter named `task` that
        the `parameters` schema does not list."""
        props = self.parameters.get("properties") if isinstance(self.parameters, dict) else None
        if isinstance(props, dict) and "task" in props:
            return False
        try:
            params = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):  # a builtin without a signature
            return False
        task = params.get("task")
        return task is not None and task.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        )

    def spec(self) -> dict[str, Any]:
        """The OpenAI `tools` entry for this tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


async def run_tool(tool: Tool, arguments: str | dict, task: Task | None = None) -> tuple[str, bool]:
    """Runs `tool` on JSON `arguments`; returns (text for the model, ok). A tool that
    takes the task (`Tool.takes_task`) gets `task`; the model cannot give it.

    Bad JSON, a wrong argument, an exception or a timeout give ok=False and an
    error text naming what went wrong. Sync tools run on `tool_executor()`, not
    the default executor; a timed-out one's thread runs on there until it returns.
    A tool with `sandbox` limits runs in a child process (`run_sandboxed`),
    whose wall-time limit kills it.
    """
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
        if not isinstance(args, dict):
            raise ValueError("arguments must be a JSON object")
    except (json.JSONDecodeError, ValueError, TypeError) as e:
        return f"error: {tool.name}: bad arguments ({e})", False
    if tool.takes_task:
        if "task" in args:
            return f"error: {tool.name}: 'task' is not an argument the model gives", False
        if task is None:
            return f"error: {tool.name} takes the task, and none was given to run_tool", False
        args["task"] = task
    if tool.sandbox is not None:
        return await run_sandboxed(tool.name, tool.fn, args, tool.sandbox, tool.timeout_s)
    try:
        if inspect.iscoroutinefunction(tool.fn):
            result = await asyncio.wait_for(tool.fn(**args), tool.timeout_s)
        else:
            loop = asyncio.get_running_loop()
            call = loop.run_in_executor(tool_executor(), lambda: tool.fn(**args))
            result = await asyncio.wait_for(call, tool.timeout_s)
    except TimeoutError:
        return f"error: {tool.name} timed out after {tool.timeout_s:g}s", False
    except Exception as e:  # noqa: BLE001 - the model sees the error, the loop goes on
        return f"error: {tool.name}: {type(e).__name__}: {e}", False
    return str(result), True


class Env(abc.ABC):
    """Tasks + tools + verifier. Subclasses fill in the three."""

    name: str = "env"
    system_prompt: str | None = None
    # The rewards `verify` may give (ac2_jax.evals.audit flags any outside it).
    reward_range: tuple[float, float] = (0.0, 1.0)

    @abc.abstractmethod
    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        """n tasks, deterministic in (seed, split); splits never overlap."""

    @property
    def tools(self) -> list[Tool]:
        return []

    def tool(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)

    @abc.abstractmethod
    def verify(self, task: Task, answer: str | None) -> float:
        """Reward of a final answer text (None: no answer was given)."""

    def turn_rewards(self, task: Task, messages: list[dict[str, Any]]) -> list[float] | None:
        """One reward per assistant turn of a finished attempt's conversation (`messages`,
        as the harness holds it), or None (the default): no per-turn rewards. What an
        env returns here is recorded with the attempt (its trace's
        `metadata["artifacts"]["turn_rewards"]`, `orchestration.run_rollout`) and read by
        per-turn credit (`rl.batch.credit="turn"`, `training.rl.credit`); `verify`
        still gives the attempt's one reward."""
        return None

    def reference_answer(self, task: Task) -> str | None:
        """A final answer text that solves `task` (`verify` must pass it), or None
        when the env has none. The environment audit checks solvability with it."""
        return None

    def judge_memo(self, task: Task, messages: list[dict[str, Any]], memo: str) -> bool | None:
        """Whether a compaction memo carries what the next step needs, given the
        history it replaced (`messages`); None when the env cannot judge (the
        default). The CompactionOrchestrator records it as the event's `memo_ok`."""
        return None

    def initial_messages(self, task: Task) -> list[dict[str, Any]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": task.prompt}]
