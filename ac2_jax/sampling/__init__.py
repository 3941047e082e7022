"""Samplers: token ids in, token ids + log-probs out (see `base`).

Layout: `base` (the `Sampler` contract), `registry` (sampler kinds, `SamplerConfig`),
`constraints` (grammars: what `SamplingParams.constraint` holds and the learner's mask
replay), `engine/` (the embedded `JaxSampler`) and `remote/` (`SGLangSampler`,
`FleetSampler`). The modules' old flat paths (`ac2_jax.sampling.jax_sampler`, ...) are
deprecation aliases for one release (`ac2_jax._deprecation.MOVED_MODULES`).
"""

from ac2_jax._deprecation import install_moved_modules
from ac2_jax.sampling.base import (
    ContextLengthError,
    Sampler,
    SamplerError,
    SampleResult,
    SamplerUnavailable,
    SamplingParams,
)
from ac2_jax.sampling.base import check_prompt as check_prompt
from ac2_jax.sampling.base import truncate_at_stop as truncate_at_stop
from ac2_jax.sampling.constraints import ConstraintError as ConstraintError
from ac2_jax.sampling.constraints import GrammarMatcher as GrammarMatcher
from ac2_jax.sampling.constraints import any_json_grammar as any_json_grammar
from ac2_jax.sampling.constraints import check_grammar as check_grammar
from ac2_jax.sampling.constraints import end_token_id as end_token_id
from ac2_jax.sampling.constraints import json_schema_grammar as json_schema_grammar
from ac2_jax.sampling.constraints import ll_tokenizer as ll_tokenizer
from ac2_jax.sampling.constraints import replay_masks as replay_masks
from ac2_jax.sampling.constraints import tool_call_grammar as tool_call_grammar
from ac2_jax.sampling.engine.batching import occupancy_metrics as occupancy_metrics
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.sampling.registry import (
    SAMPLERS,
    SamplerConfig,
    SamplerKind,
    SamplerSetup,
    build_sampler,
)
from ac2_jax.sampling.remote.fleet import FleetSampler
from ac2_jax.sampling.remote.fleet import route_key as route_key
from ac2_jax.sampling.remote.sglang import SGLangSampler

__all__ = [
    "Sampler",
    "SampleResult",
    "SamplingParams",
    "SamplerError",
    "SamplerUnavailable",
    "ContextLengthError",
    "SAMPLERS",
    "SamplerConfig",
    "SamplerKind",
    "SamplerSetup",
    "build_sampler",
    "JaxSampler",
    "SGLangSampler",
    "FleetSampler",
]

install_moved_modules(__name__)
