"""Samplers: token ids in, token ids + log-probs out (see `base`)."""

from ac2_jax.sampling.base import (
    ContextLengthError,
    OnTokens,
    SampleResult,
    Sampler,
    SamplerError,
    SamplingParams,
    check_prompt,
    truncate_at_stop,
)
from ac2_jax.sampling.jax_sampler import JaxSampler, SamplerStats
from ac2_jax.sampling.sglang import SGLangError, SGLangSampler

__all__ = [
    "JaxSampler",
    "SamplerStats",
    "SGLangError",
    "SGLangSampler",
    "ContextLengthError",
    "OnTokens",
    "SampleResult",
    "Sampler",
    "SamplerError",
    "SamplingParams",
    "check_prompt",
    "truncate_at_stop",
]
