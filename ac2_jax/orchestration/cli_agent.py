"""Real command-line agents as harnesses: Claude Code, Codex, or any CLI.

A production coding agent trains unchanged: each attempt runs the agent's own
command-line program as a subprocess in a scratch directory, with its base
URL and API key pointed at the attempt's rollout (so every model call it
makes is recorded token by token under that rollout), under a wall-clock
timeout. When the program exits, the environment's verifier grades the
directory it left.

    env = CLIAgentEnv(fix_the_tests_tasks(), claude_code())
    recipes.rl("path/to/model", env, config)      # or python -m ac2_jax.train

`CLIAgent` says how to launch one program: its argv and environment for a
(prompt, model, base_url, api_key, scratch home). `claude_code()` speaks the
Anthropic Messages API (`ANTHROPIC_BASE_URL`, `x-api-key`), `codex()` the
OpenAI Responses API (a `model_providers` entry with `wire_api="responses"`).
Both are launched headless (`claude -p`, `codex exec`) with a private HOME,
telemetry and auto-update off, and options that keep their requests within
what the endpoint serves (documented at each preset).

Outcomes: exit status 0 -> the attempt finished and `Env.verify` grades the
directory (the answer it gets is the JSON of `CLIResult`); a non-zero exit
-> `CLIAgentError` (an infra_error: a program that fails, e.g. because the
endpoint refused one of its requests, is never trained on); past the
timeout the whole process group is killed and the attempt ends as timed_out.
The last lines of the program's output are kept in the error and the result.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from ac2_jax.envs.base import Env, Task
from ac2_jax.orchestration.base import Orchestrator

__all__ = [
    "CLIAgent",
    "CLIAgentEnv",
    "CLIAgentError",
    "CLIAgentHarness",
    "CLIResult",
    "Launch",
    "claude_code",
    "codex",
    "fix_the_tests_tasks",
    "unittest_passes",
]

TAIL_CHARS = 4000  # of stdout / stderr kept in a result or error


class CLIAgentError(RuntimeError):
    """The program failed (non-zero exit, or it could not start): ours, never trained."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """What a `CLIAgent` is asked to launch against."""

    prompt: str
    model: str
    base_url: str  # the rollout's OpenAI-style base URL, ".../v1"
    api_key: str  # the rollout key
    workdir: str  # the scratch directory the agent works in (its cwd)
    home: str  # a private HOME for the program's own config and caches


@dataclasses.dataclass(frozen=True)
class CLIAgent:
    """One command-line agent: `argv(launch)` and `environ(launch)` (added to a
    minimal environment: PATH, LANG, and the program's HOME). `api` names the
    request API it speaks ("anthropic" or "responses"), for reports."""

    name: str
    api: str
    argv: Callable[[Launch], list[str]]
    environ: Callable[[Launch], dict[str, str]]


def _root_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def claude_code(
    executable: str = "claude",
    *,
    system_prompt: str | None = "You are a coding agent. Work in the current directory.",
    tools: Sequence[str] = ("Bash", "Read", "Write", "Edit"),
    max_turns: int = 8,
) -> CLIAgent:
    """Claude Code (`npm install @anthropic-ai/claude-code`), headless (`claude -p`).

    `--bare` skips hooks, plugins and CLAUDE.md discovery; `system_prompt`
    replaces the default one (None keeps Claude Code's own, about 20k tokens:
    the served model needs the context for it); `tools` are the built-in tools
    offered (`--tools`); `--dangerously-skip-permissions` lets it act in its
    scratch directory without asking (IS_SANDBOX=1 allows that as root). It
    sends `thinking: {"type": "adaptive"}`, `output_config.effort`,
    `context_management` (clear_thinking) and `cache_control`, which the
    endpoint's /v1/messages accepts (serving/messages.py says how).
    """

    def argv(launch: Launch) -> list[str]:
        out = [executable, "-p", launch.prompt, "--bare", "--model", launch.model]
        out += ["--output-format", "json", "--max-turns", str(max_turns)]
        out += ["--dangerously-skip-permissions", "--tools", ",".join(tools)]
        if system_prompt is not None:
            out += ["--system-prompt", system_prompt]
        return out

    def environ(launch: Launch) -> dict[str, str]:
        return {
            "ANTHROPIC_BASE_URL": _root_url(launch.base_url),
            "ANTHROPIC_API_KEY": launch.api_key,
            "IS_SANDBOX": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }

    return CLIAgent("claude-code", "anthropic", argv, environ)


def codex(
    executable: str = "codex",
    *,
    instructions: str | None = "You are a coding agent. Use exec_command to run shell commands.",
) -> CLIAgent:
    """Codex (`npm install @openai/codex`), headless (`codex exec`).

    The rollout is a `model_providers.ac2` entry (`wire_api = "responses"`, the
    key in AC2_ROLLOUT_KEY). Web search, multi-agent and goal tools are turned
    off (the endpoint refuses built-in tools and tool namespaces by name),
    reasoning summaries off; `instructions` replace Codex's base instructions
    (`model_instructions_file`; None keeps its own, about 5k tokens). The
    sandbox is off (`danger-full-access`): the scratch directory is the
    boundary, as in a container.
    """

    def argv(launch: Launch) -> list[str]:
        provider = (
            f'{{name="ac2",base_url="{launch.base_url}",env_key="AC2_ROLLOUT_KEY",'
            f'wire_api="responses"}}'
        )
        overrides = [
            "model_provider=ac2",
            f"model_providers.ac2={provider}",
            'web_search="disabled"',
            "features.multi_agent=false",
            "features.goals=false",
            'model_reasoning_summary="none"',
            'sandbox_mode="danger-full-access"',
            'approval_policy="never"',
        ]
        if instructions is not None:
            path = os.path.join(launch.home, "instructions.md")
            with open(path, "w") as f:
                f.write(instructions)
            overrides.append(f'model_instructions_file="{path}"')
        out = [executable, "exec", "--skip-git-repo-check", "-m", launch.model]
        out += ["--cd", launch.workdir]
        for o in overrides:
            out += ["-c", o]
        return out + [launch.prompt]

    def environ(launch: Launch) -> dict[str, str]:
        return {"AC2_ROLLOUT_KEY": launch.api_key}  # its config lives in HOME/.codex

    return CLIAgent("codex", "responses", argv, environ)


@dataclasses.dataclass
class CLIResult:
    """What one run of the program left: its exit code, output tails, the
    directory it worked in (graded by the verifier), and its wall time."""

    workdir: str
    exit_code: int
    stdout: str
    stderr: str
    wall_s: float

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> CLIResult:
        return cls(**json.loads(text))


def _tail(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")[-TAIL_CHARS:]


async def run_cli(agent: CLIAgent, launch: Launch, timeout_s: float) -> CLIResult:
    """Runs the program to its end (TimeoutError past `timeout_s`, after killing
    its whole process group); CLIAgentError when it cannot start."""
    env = {
        "PATH": os.environ.get("PATH", ""),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": launch.home,
        **agent.environ(launch),
    }
    argv = agent.argv(launch)
    t0 = time.monotonic()
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            cwd=launch.workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own process group: a timeout kills all of it
        )
    except OSError as e:
        raise CLIAgentError(f"{agent.name}: could not start {argv[0]!r}: {e}") from e
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except (TimeoutError, asyncio.CancelledError):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(proc.wait(), 10)
        raise
    return CLIResult(
        launch.workdir, int(proc.returncode or 0), _tail(out), _tail(err), time.monotonic() - t0
    )


class CLIAgentHarness(Orchestrator):
    """One attempt by a command-line agent (see the module docstring).

    The rollout's base URL and key come from the OpenAI client `run_rollout`
    binds to the rollout; the program's model calls go straight to the
    endpoint and are recorded there (this harness makes none itself).
    """

    def __init__(self, env: CLIAgentEnv, task: Task, client, model: str, **kw):
        super().__init__(env, task, client, model, **kw)
        self.cli_env = env

    async def run(self, turn_input: str) -> None:
        env = self.cli_env
        workdir = tempfile.mkdtemp(prefix="ac2-cli-", dir=env.scratch_root)
        home = os.path.join(workdir, ".home")
        os.makedirs(home)
        env.setup(self.trace.task, workdir)
        base_url = str(self.client.base_url).rstrip("/")
        launch = Launch(turn_input, self.model, base_url, str(self.client.api_key), workdir, home)
        try:
            result = await run_cli(env.agent, launch, env.timeout_s)
        except BaseException:
            env.cleanup(workdir)
            raise
        self.trace.metrics["cli_exit_code"] = result.exit_code
        self.trace.metrics["cli_wall_s"] = result.wall_s
        self.trace.events.append({"kind": "cli", "agent": env.agent.name, **_event(result)})
        if result.exit_code != 0:
            env.cleanup(workdir)
            raise CLIAgentError(
                f"{env.agent.name} exited with status {result.exit_code}: "
                f"{result.stderr[-1000:] or result.stdout[-1000:]}"
            )
        self.trace.answer = result.to_json()
        self.trace.status = "finished"


def _event(result: CLIResult) -> dict[str, Any]:
    return {"exit_code": result.exit_code, "wall_s": result.wall_s, "stdout": result.stdout[-500:]}


class CLIAgentEnv(Env):
    """Tasks done by a command-line agent in a scratch directory.

    tasks: the task list (`Task.metadata["files"]`: {relative path: text}
    written into the directory first). check(task, workdir, result) -> reward
    grades what the agent left. sample_tasks draws from `tasks` by split
    (`Task.metadata["split"]`, default "train"). The directory is removed after
    grading unless keep_dirs.
    """

    name = "cli_agent"

    def __init__(
        self,
        tasks: Sequence[Task],
        agent: CLIAgent,
        check: Callable[[Task, str, CLIResult], float],
        *,
        timeout_s: float = 600.0,
        scratch_root: str | None = None,
        keep_dirs: bool = False,
    ):
        if not tasks:
            raise ValueError("CLIAgentEnv: no tasks")
        self.tasks = list(tasks)
        self.agent = agent
        self.check = check
        self.timeout_s = timeout_s
        self.scratch_root = scratch_root
        self.keep_dirs = keep_dirs

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        """n draws from the split's tasks, in order from `seed`; each draw gets its own
        id (`<task_id>/<seed>.<i>`) so repeated tasks stay distinct attempts groups."""
        pool = [t for t in self.tasks if t.metadata.get("split", "train") == split]
        if not pool:
            raise ValueError(
                f"CLIAgentEnv: no task has split {split!r} (set Task.metadata['split'])"
            )
        start = seed % len(pool)
        return [
            dataclasses.replace(
                pool[(start + i) % len(pool)],
                task_id=f"{pool[(start + i) % len(pool)].task_id}/{seed}.{i}",
            )
            for i in range(n)
        ]

    def setup(self, task: Task, workdir: str) -> None:
        for rel, text in task.metadata.get("files", {}).items():
            path = os.path.join(workdir, rel)
            if os.path.commonpath([workdir, os.path.abspath(path)]) != workdir:
                raise ValueError(f"task {task.task_id}: file {rel!r} is outside the directory")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)

    def cleanup(self, workdir: str) -> None:
        if not self.keep_dirs:
            shutil.rmtree(workdir, ignore_errors=True)

    def verify(self, task: Task, answer: str | None) -> float:
        if answer is None:
            return 0.0
        result = CLIResult.from_json(answer)
        try:
            return float(self.check(task, result.workdir, result))
        finally:
            self.cleanup(result.workdir)

    def make_harness(self, task: Task, client, model_name: str, *, sampling=None, max_steps=8):
        """The harness the recipes use (`recipes.common.harness_factory`)."""
        return CLIAgentHarness(
            self, task, client, model_name, sampling=sampling, max_steps=max_steps
        )


# ------------------------------------------------------------------------------ tasks

_BUGGY = {
    "add": ("def add(a, b):\n    return a - b\n", "add(2, 3)", 5),
    "mul": ("def mul(a, b):\n    return a + b\n", "mul(4, 5)", 20),
    "neg": ("def neg(a):\n    return a\n", "neg(7)", -7),
    "sq": ("def sq(a):\n    return a * 2\n", "sq(6)", 36),
}


def fix_the_tests_tasks() -> list[Task]:
    """ "Make the tests pass" tasks: a one-line bug in calc.py and a unittest file
    that shows it. Grade them with `unittest_passes`."""
    tasks = []
    for i, (name, (code, call, want)) in enumerate(sorted(_BUGGY.items())):
        test = (
            "import unittest\nfrom calc import *\n\n\nclass T(unittest.TestCase):\n"
            f"    def test_it(self):\n        self.assertEqual({call}, {want})\n"
        )
        tasks.append(
            Task(
                task_id=f"fix-{name}",
                prompt="The test in test_calc.py fails. Fix calc.py so that it passes.",
                metadata={
                    "files": {"calc.py": code, "test_calc.py": test},
                    "split": "eval" if i == 0 else "train",
                },
            )
        )
    return tasks


def unittest_passes(task: Task, workdir: str, result: CLIResult) -> float:
    """1.0 when `python -m unittest` passes in the directory the agent left."""
    proc = subprocess.run(
        [sys.executable, "-m", "unittest", "-q"],
        cwd=workdir,
        capture_output=True,
        timeout=60,
        env={"PATH": os.environ.get("PATH", ""), "PYTHONDONTWRITEBYTECODE": "1"},
    )
    return float(proc.returncode == 0)
