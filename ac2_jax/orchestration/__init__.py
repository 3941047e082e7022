"""Orchestrators: the one loop that runs every harness shape; the adapters whose harness
is another library's own loop (verifiers) or replays a whole game (TextArena)."""

from ac2_jax.orchestration.base import (
    AGENT_HEADER,
    ConversationTrace,
    EnvUser,
    Orchestrator,
    ScriptedUser,
    SingleTaskUser,
    User,
    request_seed,
    run_task,
)
from ac2_jax.orchestration.cli_agent import (
    CLIAgent,
    CLIAgentEnv,
    CLIAgentError,
    CLIAgentHarness,
    CLIResult,
    Launch,
    exit_status_outcome,
)
from ac2_jax.orchestration.cli_presets import (
    claude_code,
    codex,
    fix_the_tests_tasks,
    gemini_cli,
    opencode,
    qwen_code,
    unittest_passes,
)
from ac2_jax.orchestration.default import (
    CompactionOrchestrator,
    DefaultOrchestrator,
    MultiResponseOrchestrator,
    SubagentOrchestrator,
    format_error_message,
    tool_format_error,
)
from ac2_jax.orchestration.gym_env import GymHarness, GymTextEnv, gym_env
from ac2_jax.orchestration.openenv_env import OpenEnvEnv, OpenEnvError, openenv_env
from ac2_jax.orchestration.rollouts import (
    LifecycleClient,
    LifecycleError,
    classify_error,
    run_rollout,
)
from ac2_jax.orchestration.textarena_env import TextArenaEnv, TextArenaHarness, textarena_env
from ac2_jax.orchestration.verifiers_env import (
    VerifiersEnv,
    VerifiersError,
    VerifiersHarness,
    verifiers_env,
)

__all__ = [
    "AGENT_HEADER",
    "CLIAgent",
    "CLIAgentEnv",
    "CLIAgentError",
    "CLIAgentHarness",
    "CLIResult",
    "CompactionOrchestrator",
    "ConversationTrace",
    "DefaultOrchestrator",
    "EnvUser",
    "GymHarness",
    "GymTextEnv",
    "Launch",
    "LifecycleClient",
    "LifecycleError",
    "MultiResponseOrchestrator",
    "OpenEnvEnv",
    "OpenEnvError",
    "Orchestrator",
    "ScriptedUser",
    "SingleTaskUser",
    "SubagentOrchestrator",
    "TextArenaEnv",
    "TextArenaHarness",
    "User",
    "VerifiersEnv",
    "VerifiersError",
    "VerifiersHarness",
    "classify_error",
    "claude_code",
    "codex",
    "exit_status_outcome",
    "fix_the_tests_tasks",
    "gemini_cli",
    "opencode",
    "qwen_code",
    "format_error_message",
    "gym_env",
    "openenv_env",
    "request_seed",
    "run_rollout",
    "run_task",
    "textarena_env",
    "tool_format_error",
    "unittest_passes",
    "verifiers_env",
]
