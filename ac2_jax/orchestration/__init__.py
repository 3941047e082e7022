"""Orchestrators: the one loop that runs every harness shape; the adapters whose harness
is another library's own loop (verifiers) or replays a whole game (TextArena)."""

from ac2_jax._deprecation import deprecated_getattr
from ac2_jax.orchestration.base import EnvUser, Orchestrator, User
from ac2_jax.orchestration.base import SingleTaskUser as SingleTaskUser
from ac2_jax.orchestration.base import run_task as run_task
from ac2_jax.orchestration.cli_agent import CLIAgent, CLIAgentEnv
from ac2_jax.orchestration.cli_presets import claude_code, codex, gemini_cli, opencode, qwen_code
from ac2_jax.orchestration.cli_presets import fix_the_tests_tasks as fix_the_tests_tasks
from ac2_jax.orchestration.cli_presets import unittest_passes as unittest_passes
from ac2_jax.orchestration.default import (
    CompactionOrchestrator,
    DefaultOrchestrator,
    MultiResponseOrchestrator,
    SubagentOrchestrator,
)
from ac2_jax.orchestration.gym_env import gym_env
from ac2_jax.orchestration.openenv_env import OpenEnvError as OpenEnvError
from ac2_jax.orchestration.openenv_env import openenv_env
from ac2_jax.orchestration.rollouts import LifecycleClient, run_rollout
from ac2_jax.orchestration.rollouts import classify_error as classify_error
from ac2_jax.orchestration.textarena_env import textarena_env
from ac2_jax.orchestration.verifiers_env import verifiers_env

# Renamed or moved; resolve with a DeprecationWarning for one release.
DEPRECATED = {
    "request_seed": "ac2_jax.seeds:request_seed",
}
__getattr__ = deprecated_getattr(__name__, DEPRECATED)

__all__ = [
    "Orchestrator",
    "DefaultOrchestrator",
    "CompactionOrchestrator",
    "SubagentOrchestrator",
    "MultiResponseOrchestrator",
    "User",
    "EnvUser",
    "run_rollout",
    "LifecycleClient",
    "CLIAgent",
    "CLIAgentEnv",
    "claude_code",
    "codex",
    "gemini_cli",
    "opencode",
    "qwen_code",
    "gym_env",
    "openenv_env",
    "textarena_env",
    "verifiers_env",
]
