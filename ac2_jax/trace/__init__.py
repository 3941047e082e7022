"""Traces: every conversation of one task attempt, as append-only episodes."""

from ac2_jax.trace.agents import COMPACTOR, MAIN, agent_matches
from ac2_jax.trace.agents import SUBAGENT_WILDCARD as SUBAGENT_WILDCARD
from ac2_jax.trace.agents import agent_group as agent_group
from ac2_jax.trace.agents import check_agent_pattern as check_agent_pattern
from ac2_jax.trace.agents import is_subagent as is_subagent
from ac2_jax.trace.recorder import TraceRecorder
from ac2_jax.trace.routing import decode_routing as decode_routing
from ac2_jax.trace.routing import encode_routing as encode_routing
from ac2_jax.trace.routing import routing_length as routing_length
from ac2_jax.trace.store import TraceStore, TraceStoreError
from ac2_jax.trace.types import TRACE_STATUSES as TRACE_STATUSES
from ac2_jax.trace.types import Completion, Episode, Message, Trace, TraceStatus

__all__ = [
    "Trace",
    "Episode",
    "Completion",
    "Message",
    "TraceStatus",
    "TraceRecorder",
    "TraceStore",
    "TraceStoreError",
    "MAIN",
    "COMPACTOR",
    "agent_matches",
]
