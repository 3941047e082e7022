"""Presets for `cli_agent`: five production agent CLIs, and a small task family.

Each preset runs its CLI with its own default settings: only the base URL, the
key, the model and the telemetry / auto-update switches are set (plus the
headless switches each needs to act without asking, and the output format its
outcome is read from). What each sends and how the endpoint takes each field is
in docs/notes/2026-12-07-production-agent-clis-default-settings.md.

  claude_code()  Claude Code, `claude -p`: the Anthropic Messages API
                 (ANTHROPIC_BASE_URL, x-api-key).
  codex()        Codex, `codex exec`: the OpenAI Responses API (a `model_providers`
                 entry with wire_api "responses").
  gemini_cli()   Gemini CLI, `gemini -p`: the Gemini API (GOOGLE_GEMINI_BASE_URL,
                 x-goog-api-key).
  qwen_code()    Qwen Code, `qwen -p`: OpenAI Chat Completions (OPENAI_BASE_URL).
  opencode()     opencode, `opencode run`: OpenAI Chat Completions (a provider in
                 OPENCODE_CONFIG_CONTENT, @ai-sdk/openai-compatible).

Each gets a private HOME. Side conversations a CLI holds besides the task
(opencode's title generator, Qwen Code's memory extraction) are labelled by
`CLIAgent.agent_rules` (their own agent label in the trace: `train_agents`
includes or leaves them out). `fix_the_tests_tasks()` + `unittest_passes` are
"make the tests pass" tasks graded by the directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

from ac2_jax.envs.base import Task
from ac2_jax.orchestration.cli_agent import CLIAgent, CLIResult, Launch, exit_status_outcome

__all__ = [
    "claude_code",
    "codex",
    "fix_the_tests_tasks",
    "gemini_cli",
    "opencode",
    "qwen_code",
    "unittest_passes",
]


def _root_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def _write_json(path: str, value: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(value, f)


def claude_code(
    executable: str = "claude",
    *,
    system_prompt: str | None = None,
    tools: Sequence[str] | None = None,
    max_turns: int | None = None,
    bare: bool = False,
) -> CLIAgent:
    """Claude Code (`npm install @anthropic-ai/claude-code`), headless (`claude -p`).

    By default unchanged: its own system prompt (about 48k tokens of the tiny
    tokenizer with its tools: serve the model with the context for it), its own
    tools and no turn limit. `--dangerously-skip-permissions` lets it act in its
    scratch directory without asking (IS_SANDBOX=1 allows that as root);
    `--output-format json` is what `outcome` reads. Options narrow it: a
    `system_prompt` replacing its own, `tools` (`--tools`), `max_turns`, `bare`
    (`--bare`: no hooks, plugins or CLAUDE.md discovery). It sends a
    mid-conversation system message, `thinking: {"type": "adaptive"}`,
    `output_config.effort`, `context_management` (clear_thinking) and
    `cache_control`, which /v1/messages takes (serving/apis/messages/routes.py says how).
    """

    def argv(launch: Launch) -> list[str]:
        out = [executable, "-p", launch.prompt, "--model", launch.model]
        out += ["--output-format", "json", "--dangerously-skip-permissions"]
        if bare:
            out.append("--bare")
        if tools is not None:
            out += ["--tools", ",".join(tools)]
        if max_turns is not None:
            out += ["--max-turns", str(max_turns)]
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
    instructions: str | None = None,
    config: Sequence[str] = (),
) -> CLIAgent:
    """Codex (`npm install @openai/codex`), headless (`codex exec`).

    The rollout is a `model_providers.ac2` entry (`wire_api = "responses"`, the
    key in AC2_ROLLOUT_KEY). By default unchanged: its base instructions, its
    tools (the multi-agent `namespace` group and `web_search` included: the
    endpoint offers the group's functions and leaves web_search out of the
    prompt, counted, under its default --builtin_tools=omit). The sandbox is off
    (`danger-full-access`) and approvals never asked (headless: the scratch
    directory is the boundary, as in a container); the update check off.
    `instructions` replace the base instructions (`model_instructions_file`);
    `config`: more `-c key=value` overrides.
    """

    def argv(launch: Launch) -> list[str]:
        provider = (
            f'{{name="ac2",base_url="{launch.base_url}",env_key="AC2_ROLLOUT_KEY",'
            f'wire_api="responses"}}'
        )
        overrides = [
            "model_provider=ac2",
            f"model_providers.ac2={provider}",
            'sandbox_mode="danger-full-access"',
            'approval_policy="never"',
            "check_for_update_on_startup=false",
            *config,
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


# Telemetry, usage statistics and updates off: Gemini CLI's and Qwen Code's settings.json.
_QUIET_SETTINGS = {
    "telemetry": {"enabled": False},
    "privacy": {"usageStatisticsEnabled": False},
    "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
}


def gemini_cli(executable: str = "gemini") -> CLIAgent:
    """Gemini CLI (`npm install @google/gemini-cli`), headless (`gemini -p`), against
    the endpoint's Gemini API (GOOGLE_GEMINI_BASE_URL: the server root; the key as
    GEMINI_API_KEY, sent as x-goog-api-key; ~/.gemini/settings.json selects API-key
    auth and turns telemetry, usage statistics and updates off). `--yolo` lets it act
    without asking and GEMINI_CLI_TRUST_WORKSPACE trusts the scratch directory
    (headless runs refuse untrusted ones). Its default request: systemInstruction,
    functionDeclarations (parametersJsonSchema), generationConfig with topK and
    thinkingConfig.includeThoughts, streamed (?alt=sse)."""

    def argv(launch: Launch) -> list[str]:
        settings = {**_QUIET_SETTINGS, "security": {"auth": {"selectedType": "gemini-api-key"}}}
        _write_json(os.path.join(launch.home, ".gemini", "settings.json"), settings)
        return [executable, "-p", launch.prompt, "-m", launch.model, "--yolo"]

    def environ(launch: Launch) -> dict[str, str]:
        return {
            "GOOGLE_GEMINI_BASE_URL": _root_url(launch.base_url),
            "GEMINI_API_KEY": launch.api_key,
            "GEMINI_CLI_TRUST_WORKSPACE": "true",
        }

    return CLIAgent("gemini-cli", "gemini", argv, environ)


# Qwen Code's side conversations: its memory agents run on system prompts of their own.
QWEN_MEMORY_RULES = (
    {"agent": "memory", "system_regex": r"^You are now acting as the managed memory extraction"},
    {"agent": "memory", "system_regex": r"^You are performing a managed memory dream"},
    {"agent": "memory", "system_regex": r"^You are selecting memories"},
)


def qwen_code(executable: str = "qwen") -> CLIAgent:
    """Qwen Code (`npm install @qwen-code/qwen-code`), headless (`qwen -p`), against
    /v1/chat/completions (OPENAI_BASE_URL, OPENAI_API_KEY, OPENAI_MODEL); settings.json
    turns telemetry, usage statistics and updates off; `--yolo` lets it act without
    asking. Its memory agents are labelled "memory" (`QWEN_MEMORY_RULES`)."""

    def argv(launch: Launch) -> list[str]:
        _write_json(os.path.join(launch.home, ".qwen", "settings.json"), _QUIET_SETTINGS)
        return [executable, "-p", launch.prompt, "-m", launch.model, "--yolo"]

    def environ(launch: Launch) -> dict[str, str]:
        return {
            "OPENAI_BASE_URL": launch.base_url,
            "OPENAI_API_KEY": launch.api_key,
            "OPENAI_MODEL": launch.model,
        }

    return CLIAgent("qwen-code", "chat", argv, environ, agent_rules=QWEN_MEMORY_RULES)


# opencode's side conversation: a title for the session, on its own system prompt.
OPENCODE_TITLE_RULES = ({"agent": "title", "system_regex": r"^You are a title generator"},)


def opencode(executable: str = "opencode") -> CLIAgent:
    """opencode (`npm install opencode-ai`), headless (`opencode run`), against
    /v1/chat/completions: the rollout is a provider "ac2" in OPENCODE_CONFIG_CONTENT
    (@ai-sdk/openai-compatible, which opencode installs into its HOME on first use:
    it needs the npm registry), the model "ac2/<model>"; autoupdate and sharing
    off. Its title generator is labelled "title" (`OPENCODE_TITLE_RULES`)."""

    def environ(launch: Launch) -> dict[str, str]:
        provider = {
            "npm": "@ai-sdk/openai-compatible",
            "name": "ac2",
            "options": {"baseURL": launch.base_url, "apiKey": launch.api_key},
            "models": {launch.model: {"name": launch.model}},
        }
        config = {
            "provider": {"ac2": provider},
            "model": f"ac2/{launch.model}",
            "autoupdate": False,
            "share": "disabled",
        }
        return {
            "OPENCODE_CONFIG_CONTENT": json.dumps(config),
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
        }

    def argv(launch: Launch) -> list[str]:
        return [executable, "run", launch.prompt, "-m", f"ac2/{launch.model}"]

    return CLIAgent("opencode", "chat", argv, environ, agent_rules=OPENCODE_TITLE_RULES)


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
