"""Samplers: token ids in, token ids + log-probs out (see `base`)."""

from ac2_jax.sampling.base import (
    ContextLengthError,
    SampleResult,
    Sampler,
    SamplingParams,
    check_prompt,
    truncate_at_stop,
)

__all__ = [
    "ContextLengthError",
    "SampleResult",
    "Sampler",
    "SamplingParams",
    "check_prompt",
    "truncate_at_stop",
]
