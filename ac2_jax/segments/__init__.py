"""Segments: traces cut into training sequences and packed into batches."""

from ac2_jax.segments.packing import PackedBatch, pack_segments, task_names
from ac2_jax.segments.segments import Segment, segments_from_trace

__all__ = ["PackedBatch", "Segment", "pack_segments", "segments_from_trace", "task_names"]
