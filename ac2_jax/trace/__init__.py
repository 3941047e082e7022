"""Traces: every conversation of one task attempt, as append-only episodes."""

from ac2_jax.trace.agents import (
    COMPACTOR,
    MAIN,
    SUBAGENT_PREFIX,
    SUBAGENT_WILDCARD,
    agent_group,
    agent_matches,
    check_agent_pattern,
    is_subagent,
)
from ac2_jax.trace.recorder import TraceRecorder
from ac2_jax.trace.routing import decode_routing, encode_routing, routing_length
from ac2_jax.trace.store import TraceStore, TraceStoreError
from ac2_jax.trace.types import (
    END_STATUSES,
    RESULT_STATUSES,
    TRACE_STATUSES,
    Completion,
    Episode,
    Message,
    Trace,
    TraceStatus,
    messages_fingerprint,
    new_attempt_id,
)

__all__ = [
    "COMPACTOR",
    "MAIN",
    "SUBAGENT_PREFIX",
    "SUBAGENT_WILDCARD",
    "agent_group",
    "agent_matches",
    "check_agent_pattern",
    "is_subagent",
    "Completion",
    "Episode",
    "END_STATUSES",
    "RESULT_STATUSES",
    "Message",
    "TRACE_STATUSES",
    "TraceStatus",
    "Trace",
    "TraceRecorder",
    "TraceStore",
    "TraceStoreError",
    "messages_fingerprint",
    "new_attempt_id",
    "decode_routing",
    "encode_routing",
    "routing_length",
]
