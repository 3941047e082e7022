"""Segments: traces cut into training sequences and packed into batches."""

from ac2_jax.segments.batch import (
    PackedBatch,
    empty_batch,
    feature_dtypes,
    packed_lengths,
    pad_batch_rows,
    pad_rows,
    pow2_bucket,
    task_names,
)
from ac2_jax.segments.packing import first_fit_decreasing, pack_rows, pack_segments, write_segment
from ac2_jax.segments.segments import (
    SAMPLER_LOGPROBS,
    FitCounts,
    Segment,
    fit_segments,
    segments_from_trace,
)
from ac2_jax.segments.tree import pack_segment_tree

__all__ = [
    "SAMPLER_LOGPROBS",
    "FitCounts",
    "PackedBatch",
    "Segment",
    "empty_batch",
    "feature_dtypes",
    "first_fit_decreasing",
    "fit_segments",
    "pack_rows",
    "pack_segment_tree",
    "pack_segments",
    "packed_lengths",
    "pad_batch_rows",
    "pad_rows",
    "pow2_bucket",
    "segments_from_trace",
    "task_names",
    "write_segment",
]
