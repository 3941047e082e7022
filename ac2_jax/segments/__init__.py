"""Segments: traces cut into training sequences and packed into batches."""

from ac2_jax.segments.batch import (
    PackedBatch,
    empty_batch,
    feature_dtypes,
    packed_lengths,
    pad_batch_rows,
    pad_rows,
    pow2_bucket,
    routing_shape,
    task_names,
)
from ac2_jax.segments.constraints import merge_constraint_tables, resolve_constraints
from ac2_jax.segments.mask_bits import MaskTable, mask_words, pack_mask_bits, unpack_mask_bits
from ac2_jax.segments.packing import first_fit_decreasing, pack_rows, pack_segments, write_segment
from ac2_jax.segments.segments import (
    CONSTRAINT_ID,
    POLICY_VERSION,
    SAMPLER_LOGPROBS,
    FitCounts,
    Segment,
    fit_segments,
    segments_from_trace,
)
from ac2_jax.segments.tree import pack_segment_tree

__all__ = [
    "CONSTRAINT_ID",
    "POLICY_VERSION",
    "SAMPLER_LOGPROBS",
    "FitCounts",
    "MaskTable",
    "PackedBatch",
    "Segment",
    "empty_batch",
    "feature_dtypes",
    "first_fit_decreasing",
    "fit_segments",
    "mask_words",
    "merge_constraint_tables",
    "pack_mask_bits",
    "pack_rows",
    "pack_segment_tree",
    "pack_segments",
    "packed_lengths",
    "pad_batch_rows",
    "pad_rows",
    "pow2_bucket",
    "resolve_constraints",
    "routing_shape",
    "segments_from_trace",
    "task_names",
    "unpack_mask_bits",
    "write_segment",
]
