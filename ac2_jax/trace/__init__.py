"""Traces: every conversation of one task attempt, as append-only episodes."""

from ac2_jax.trace.recorder import TraceRecorder
from ac2_jax.trace.store import TraceStore, TraceStoreError
from ac2_jax.trace.types import Completion, Episode, Message, Trace

__all__ = [
    "Completion",
    "Episode",
    "Message",
    "Trace",
    "TraceRecorder",
    "TraceStore",
    "TraceStoreError",
]
