"""Samplers: token ids in, token ids + log-probs out (see `base`)."""

from ac2_jax.sampling.base import (
    ContextLengthError,
    OnTokens,
    Sampler,
    SamplerError,
    SampleResult,
    SamplerUnavailable,
    SamplingParams,
    check_prompt,
    truncate_at_stop,
)
from ac2_jax.sampling.batching import occupancy_metrics
from ac2_jax.sampling.constraints import (
    ConstraintError,
    GrammarMatcher,
    any_json_grammar,
    check_grammar,
    end_token_id,
    json_schema_grammar,
    ll_tokenizer,
    replay_masks,
    tool_call_grammar,
)
from ac2_jax.sampling.fleet import BackendState, FleetSampler, route_key
from ac2_jax.sampling.jax_sampler import JaxSampler, SamplerStats
from ac2_jax.sampling.registry import (
    SAMPLERS,
    SamplerConfig,
    SamplerKind,
    SamplerSetup,
    build_sampler,
)
from ac2_jax.sampling.sglang import SGLangError, SGLangSampler, SGLangUnavailable

__all__ = [
    "SAMPLERS",
    "SamplerConfig",
    "SamplerKind",
    "SamplerSetup",
    "build_sampler",
    "BackendState",
    "FleetSampler",
    "JaxSampler",
    "SamplerStats",
    "SGLangError",
    "SGLangSampler",
    "SGLangUnavailable",
    "ContextLengthError",
    "OnTokens",
    "SampleResult",
    "Sampler",
    "SamplerError",
    "SamplerUnavailable",
    "SamplingParams",
    "check_prompt",
    "ConstraintError",
    "GrammarMatcher",
    "any_json_grammar",
    "check_grammar",
    "end_token_id",
    "json_schema_grammar",
    "ll_tokenizer",
    "replay_masks",
    "tool_call_grammar",
    "occupancy_metrics",
    "route_key",
    "truncate_at_stop",
]
