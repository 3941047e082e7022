"""Orchestrators: the one loop that runs every harness shape."""

from ac2_jax.orchestration.base import (
    AGENT_HEADER,
    ConversationTrace,
    Orchestrator,
    ScriptedUser,
    SingleTaskUser,
    User,
    request_seed,
    run_task,
)
from ac2_jax.orchestration.default import (
    CompactionOrchestrator,
    DefaultOrchestrator,
    MultiResponseOrchestrator,
    SubagentOrchestrator,
    format_error_message,
    tool_format_error,
)
from ac2_jax.orchestration.rollouts import (
    LifecycleClient,
    LifecycleError,
    classify_error,
    run_rollout,
)

__all__ = [
    "AGENT_HEADER",
    "CompactionOrchestrator",
    "ConversationTrace",
    "DefaultOrchestrator",
    "LifecycleClient",
    "LifecycleError",
    "MultiResponseOrchestrator",
    "Orchestrator",
    "ScriptedUser",
    "SingleTaskUser",
    "SubagentOrchestrator",
    "User",
    "classify_error",
    "format_error_message",
    "request_seed",
    "run_rollout",
    "run_task",
    "tool_format_error",
]
