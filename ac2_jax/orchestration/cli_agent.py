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
(prompt, model, base_url, api_key, scratch home), and how to read its
outcome. The presets (`cli_presets`): `claude_code()` speaks the Anthropic
Messages API, `codex()` the OpenAI Responses API, `gemini_cli()` the Gemini API,
`qwen_code()` and `opencode()` OpenAI Chat Completions.

Outcomes (`CLIAgent.outcome(result)`): "finished" (by default exit status 0)
-> `Env.verify` grades the directory (the answer it gets is the JSON of
`CLIResult`); "step_limit" (the agent ran out of its own turn budget, e.g.
Claude Code's `error_max_turns`) -> the attempt ends as agent_error and the
directory is still graded, as the tool loop's step limit is; "error" (any
other non-zero exit) -> `CLIAgentError`, an infra_error: a program that
fails, e.g. because the endpoint refused one of its requests, is never
trained on. Past the timeout the attempt is `CLIAgentError` too (infra_error:
a slow sampler must not punish the policy; `run_rollout(timeout_s=)` is the
deadline that ends an attempt as timed_out). Whatever the outcome, the
program's whole process group is killed when it ends (a server it left
running in the background too), and the directory is removed after grading.
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
    "exit_status_outcome",
]

OUTCOMES = ("finished", "step_limit", "error")

TAIL_CHARS = 4000  # of stdout / stderr kept in a result or error
POLL_S = 0.05  # how often a running program is checked for its exit


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


def exit_status_outcome(result: CLIResult) -> str:
    """The default `CLIAgent.outcome`: exit status 0 is "finished", else "error"."""
    return "finished" if result.exit_code == 0 else "error"


@dataclasses.dataclass(frozen=True)
class CLIAgent:
    """One command-line agent: `argv(launch)` and `environ(launch)` (added to a
    minimal environment: PATH, LANG, and the program's HOME); `outcome(result)`
    reads how it ended: one of `OUTCOMES` (see the module docstring). `api`
    names the request API it speaks ("anthropic", "responses", "gemini", "chat"), for reports."""

    name: str
    api: str
    argv: Callable[[Launch], list[str]]
    environ: Callable[[Launch], dict[str, str]]
    outcome: Callable[[CLIResult], str] = exit_status_outcome
    # Labels of the program's side conversations (title generation, memory extraction):
    # the endpoint's agent rules ({agent, system_regex | system_sha256}), sent when each
    # attempt's rollout is created, so `train_agents` can include or leave them out.
    agent_rules: tuple[dict, ...] = ()


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
    """Runs the program to its end (TimeoutError past `timeout_s`); CLIAgentError
    when it cannot start. Its output goes to files in its HOME (a pipe would be
    held open by any child it leaves running); when it exits, times out or the
    caller is cancelled, its whole process group is killed."""
    env = {
        "PATH": os.environ.get("PATH", ""),
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "HOME": launch.home,
        **agent.environ(launch),
    }
    argv = agent.argv(launch)
    paths = [os.path.join(launch.home, f"cli.{name}") for name in ("stdout", "stderr")]
    t0 = time.monotonic()
    try:
        with open(paths[0], "wb") as out, open(paths[1], "wb") as err:
            proc = subprocess.Popen(
                argv,
                cwd=launch.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group, killed as a whole
            )
    except OSError as e:
        raise CLIAgentError(f"{agent.name}: could not start {argv[0]!r}: {e}") from e
    try:
        while proc.poll() is None:
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"{agent.name} ran past {timeout_s:g}s")
            await asyncio.sleep(POLL_S)
    finally:  # done, timed out or cancelled: nothing it started outlives it
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)  # reaped at once after SIGKILL
    out_tail, err_tail = (_tail_of(p) for p in paths)
    return CLIResult(
        launch.workdir, int(proc.returncode or 0), out_tail, err_tail, time.monotonic() - t0
    )


def _tail_of(path: str) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4 * TAIL_CHARS))
        return _tail(f.read())


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
        workdir = os.path.realpath(tempfile.mkdtemp(prefix="ac2-cli-", dir=env.scratch_root))
        try:
            home = os.path.join(workdir, ".home")
            os.makedirs(home)
            env.setup(self.trace.task, workdir)
            base_url = str(self.client.base_url).rstrip("/")
            key = str(self.client.api_key)
            launch = Launch(turn_input, self.model, base_url, key, workdir, home)
            try:
                result = await run_cli(env.agent, launch, env.timeout_s)
            except TimeoutError:
                raise CLIAgentError(
                    f"{env.agent.name} ran past its timeout of {env.timeout_s:g}s (killed)"
                ) from None
            outcome = env.agent.outcome(result)
            if outcome not in OUTCOMES:
                raise ValueError(
                    f"{env.agent.name}: outcome() gave {outcome!r}, not one of {OUTCOMES}"
                )
        except BaseException:
            env.cleanup(workdir)
            raise
        self.trace.metrics["cli_exit_code"] = result.exit_code
        self.trace.metrics["cli_wall_s"] = result.wall_s
        self.trace.events.append(
            {"kind": "cli", "agent": env.agent.name, "outcome": outcome, **_event(result)}
        )
        if outcome == "error":
            env.cleanup(workdir)
            raise CLIAgentError(
                f"{env.agent.name} exited with status {result.exit_code}: "
                f"{result.stderr[-1000:] or result.stdout[-1000:]}"
            )
        self.trace.answer = result.to_json()  # graded either way: the directory is its work
        self.trace.status = outcome


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

    @property
    def agent_rules(self) -> list[dict] | None:
        """The agent's side-conversation labels, for each attempt's rollout (`CLIAgent`)."""
        return [dict(r) for r in self.agent.agent_rules] or None

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
        """Writes the task's files into `workdir` (relative paths inside it only)."""
        workdir = os.path.realpath(workdir)
        for rel, text in task.metadata.get("files", {}).items():
            path = os.path.realpath(os.path.join(workdir, rel))
            if not rel or os.path.isabs(rel) or os.path.commonpath([workdir, path]) != workdir:
                raise ValueError(
                    f"task {task.task_id}: file {rel!r} is outside the directory (task files "
                    "are relative paths inside it)"
                )
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

    def make_harness(
        self, task: Task, client, model_name: str, *, sampling=None, max_steps=8
    ) -> CLIAgentHarness:
        """The harness the recipes use (`recipes.common.harness_factory`)."""
        return CLIAgentHarness(
            self, task, client, model_name, sampling=sampling, max_steps=max_steps
        )
