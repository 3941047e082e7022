"""Segments: traces cut into training sequences and packed into batches."""

from ac2_jax.segments.batch import PackedBatch, task_names
from ac2_jax.segments.batch import pad_batch_rows as pad_batch_rows
from ac2_jax.segments.batch import pow2_bucket as pow2_bucket
from ac2_jax.segments.batch import routing_shape as routing_shape
from ac2_jax.segments.constraints import merge_constraint_tables as merge_constraint_tables
from ac2_jax.segments.constraints import resolve_constraints as resolve_constraints
from ac2_jax.segments.mask_bits import MaskTable as MaskTable
from ac2_jax.segments.mask_bits import mask_words as mask_words
from ac2_jax.segments.mask_bits import pack_mask_bits as pack_mask_bits
from ac2_jax.segments.mask_bits import unpack_mask_bits as unpack_mask_bits
from ac2_jax.segments.packing import pack_segments
from ac2_jax.segments.segments import CONSTRAINT_ID as CONSTRAINT_ID
from ac2_jax.segments.segments import POLICY_VERSION as POLICY_VERSION
from ac2_jax.segments.segments import SAMPLER_LOGPROBS as SAMPLER_LOGPROBS
from ac2_jax.segments.segments import FitCounts, Segment, fit_segments, segments_from_trace
from ac2_jax.segments.tree import pack_segment_tree

__all__ = [
    "Segment",
    "PackedBatch",
    "FitCounts",
    "segments_from_trace",
    "fit_segments",
    "pack_segments",
    "pack_segment_tree",
    "task_names",
]
