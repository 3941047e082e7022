"""Presets for `cli_agent`: Claude Code and Codex, and a small task family.

`claude_code()` launches Claude Code headless (`claude -p`) against the
Anthropic Messages API (`ANTHROPIC_BASE_URL`, `x-api-key`); `codex()` launches
Codex headless (`codex exec`) against the OpenAI Responses API (a
`model_providers` entry with `wire_api = "responses"`). Both get a private
HOME, telemetry and auto-update off, and the options that keep their requests
within what the endpoint serves (each said at its preset; BUILD_NOTES lists
what each CLI sends and how the endpoint takes it). `fix_the_tests_tasks()` +
`unittest_passes` are "make the tests pass" tasks graded by the directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

from ac2_jax.envs.base import Task
from ac2_jax.orchestration.cli_agent import CLIAgent, CLIResult, Launch, exit_status_outcome

__all__ = ["claude_code", "codex", "fix_the_tests_tasks", "unittest_passes"]


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

    def outcome(result: CLIResult) -> str:
        # --output-format json: a result object; running out of --max-turns is the
        # agent's own limit (subtype error_max_turns, exit status 1), not a failure.
        try:
            subtype = json.loads(result.stdout.strip().splitlines()[-1]).get("subtype")
        except (ValueError, IndexError, AttributeError):
            subtype = None
        if result.exit_code != 0 and subtype == "error_max_turns":
            return "step_limit"
        return exit_status_outcome(result)

    return CLIAgent("claude-code", "anthropic", argv, environ, outcome)


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
