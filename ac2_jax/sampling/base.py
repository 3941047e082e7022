"""The Sampler protocol: token ids in, token ids + log-probs out.

Everything above this layer (the OpenAI endpoint, orchestrators, trainers)
sees a sampler only through this small contract, so the embedded JaxSampler
and the SGLangSampler are interchangeable.

Contract
--------
``await sampler.generate(prompt_ids, params, *, on_tokens=None) -> SampleResult``
    One continuation of one prompt. Safe to call concurrently from one event
    loop (a sampler may batch concurrent calls). For ``n`` samples call it
    ``n`` times (with seeds ``seed + i`` when a seed is given).

    * ``output_ids`` are exactly the sampled tokens, including the stop token
      that ended generation (EOS or one of ``params.stop_token_ids``), since
      that token was sampled and is trained on.
    * ``output_logprobs[i]`` is the log-prob of ``output_ids[i]`` under the
      distribution it was sampled from, in fp32: ``log_softmax`` of
      ``ac2_jax.losses.sampling_logits(logits, temperature, top_k, top_p)``,
      what a learner forward pass on ``prompt_ids + output_ids`` gives when it
      applies the same parameters (``token_logprobs(..., temperature=, top_k=,
      top_p=)``). Greedy (temperature 0) results carry the log-probs with no
      temperature (there is no behaviour distribution to record).
    * ``params.constraint`` (an llguidance grammar, `ac2_jax.sampling.constraints`):
      output tokens are drawn from the masked distribution and
      ``output_logprobs`` are log-probs under the mask, in this order (the
      learner applies the same): logits -> ids the grammar disallows set to
      -inf -> ``sampling_logits`` (temperature, top_k, top_p) -> log_softmax;
      greedy is the argmax of the masked logits. A position whose mask allows
      one token has log-prob 0. The mask before output_ids[i] is row i of
      ``constraints.replay_masks(grammar, tokenizer, output_ids)``: the turn's
      end token (``constraints.end_token_id``, which must be a stop id) is
      allowed only where the grammar accepts and is the only one allowed once
      the grammar is complete; other ids only where the grammar allows them.
      Nothing is cut short: if ``max_tokens`` runs out first, finish_reason is
      "length" as usual. A sampler that cannot apply a grammar raises
      ValueError naming ``constraint``.
    * ``finish_reason`` is ``"stop"`` (a stop token or stop string ended it) or
      ``"length"`` (``max_tokens`` reached, or ``max_context`` total tokens).
    * ``policy_version`` is the version of the weights that sampled the first
      output token. A sampler that swaps weights between tokens (the
      JaxSampler's ``weight_swap="in_flight"``) records each token's version
      in ``output_versions`` (None: every token was sampled by
      ``policy_version``, the only case for other samplers), and
      ``output_logprobs[i]`` is then the log-prob under version
      ``output_versions[i]`` over the whole prefix (`token_versions`).
    * ``params.stop`` (strings) may be honoured by samplers that decode text
      (SGLang); samplers without a tokenizer may ignore it. Callers that need
      stop strings apply ``truncate_at_stop`` afterwards (the serving layer
      always does), which is a no-op when the sampler already stopped there.
      A stop string keeps the token that completes it, so stop strings never
      take back tokens already accepted.
    * ``on_tokens(ids: list[int], logprobs: list[float])``, when given, is
      called (possibly from another thread: hand over with
      ``loop.call_soon_threadsafe``) each time output tokens are accepted,
      after stop-token and stop-string handling, and before the result
      resolves: the concatenation of all calls equals ``output_ids`` and
      ``output_logprobs`` exactly. An exception it raises fails this request
      (``SamplerError``) and no other.
    * Cancelling the awaiting coroutine (a client that went away) cancels the
      request: dropped from the queue if not started, its batch row freed
      otherwise; ``on_tokens`` is not called again.
    * Raises ``ContextLengthError`` when ``len(prompt_ids) >= max_context``,
      ``ValueError`` (naming the field) for an empty prompt, ids outside the
      vocabulary or parameters this sampler cannot honour, before the request
      reaches any batch; ``SamplerError`` when the sampler failed this request
      for an internal reason (the endpoint reports 503, the rollout becomes
      ``infra_error``). One request's error never fails another.
      ``SamplerUnavailable`` (a ``SamplerError``) says the request never
      reached the sampler (e.g. its server refused the connection), so another
      sampler may run it (``FleetSampler`` does).

``sampler.policy_version: int``
    Version of the weights new calls will use; 0 for the initial weights,
    otherwise the published step that ``load_weights`` loaded.

``sampler.load_weights(step: int | None = None) -> int``
    Loads the weights published with ``ac2_jax.models.publish_weights``
    (``step=None``: the latest), sets ``policy_version = step`` and returns it.
    Synchronous; callable from any thread while ``generate`` calls run. Calls
    in flight finish on the old weights (unless the sampler swaps in flight:
    see ``policy_version``); calls starting after it returns use the new ones.

``sampler.max_context: int``
    Most tokens (prompt + output) one sequence may hold.

``sampler.adapters() -> list[str]`` (optional; absent means none)
    The LoRA adapters this sampler serves by name (`models.lora`).
    ``params.adapter`` names one of them: the request samples from the base
    plus that adapter, and its ``output_logprobs`` are that model's. A sampler
    that does not serve the named adapter raises ValueError naming ``adapter``
    (never the base model in its place).

``sampler.supports_constraints: bool`` (optional; absent means False)
    Whether ``params.constraint`` grammars are decoded (JaxSampler) or refused
    (SGLangSampler). The endpoint reads it before it builds a request: without
    grammars, tool_choice falls back to the forced tool-call opening and JSON
    output formats are refused with a 400.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from ac2_jax.trace.routing import decode_routing, encode_routing

FINISH_REASONS = ("stop", "length")

INT32_MAX = 2**31 - 1
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 512  # characters per stop string
MAX_STOP_TOKEN_IDS = 64  # stop token ids per request
MAX_CONSTRAINT_CHARS = 1 << 20  # characters of one grammar
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a LoRA adapter's name
TEMPERATURE_RANGE = (1e-4, 1e4)  # besides 0 (greedy); smaller ones overflow fp32 logits

OnTokens = Callable[[list[int], list[float]], None]  # (new ids, their logprobs)


def check_adapter_name(name, field: str) -> str | None:
    """`name` if None or a valid adapter name (letters, digits, ".", "_", "-"; at most
    128), else ValueError naming `field`."""
    if name is None:
        return None
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        raise ValueError(
            f"{field} must be an adapter name (letters, digits, '.', '_', '-', starting "
            f"with a letter or digit, at most 128 characters), got {name!r}"
        )
    return name


class ContextLengthError(ValueError):
    """The prompt does not fit in the sampler's context."""


class SamplerError(RuntimeError):
    """The sampler failed this request for an internal reason; the endpoint
    reports 503 and the rollout becomes infra_error."""


class SamplerUnavailable(SamplerError):
    """The request never reached the sampler (its server refused the
    connection): nothing was sampled, so another sampler may run it."""


def _int(name: str, v, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise ValueError(f"SamplingParams.{name} must be an int, got {type(v).__name__} {v!r}")
    if not lo <= int(v) <= hi:
        raise ValueError(f"SamplingParams.{name} must be in [{lo}, {hi}], got {v}")
    return int(v)


def _real(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"SamplingParams.{name} must be a number, got {type(v).__name__} {v!r}")
    if not math.isfinite(float(v)):
        raise ValueError(f"SamplingParams.{name} must be finite, got {v}")
    return float(v)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one continuation.

    temperature 0 means greedy, else in `TEMPERATURE_RANGE`. top_k in {-1, 0}
    and top_p == 1 disable those filters (top_k >= vocab keeps every token).
    top_logprobs > 0 asks for that many (token_id, logprob) pairs per output
    position in `SampleResult.top_logprobs`. seed: any 64-bit int (signed or
    not). constraint: an llguidance grammar the output must follow (see the
    module docstring), None for none. adapter: the LoRA adapter to sample with
    (by name, `sampler.adapters()`), None for the base model. Lists are stored
    as tuples (params stay hashable). Every field is checked on construction (`checked`): ValueError
    naming the field.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_logprobs: int = 0
    constraint: str | None = None
    adapter: str | None = None

    def __post_init__(self):
        for name, value in self.checked().items():
            object.__setattr__(self, name, value)

    def checked(self) -> dict:
        """Every field validated (type, range, size) and normalised; ValueError
        naming the first bad field. Samplers call it again on admission."""
        t = _real("temperature", self.temperature)
        lo, hi = TEMPERATURE_RANGE
        if t != 0.0 and not lo <= t <= hi:
            raise ValueError(
                f"SamplingParams.temperature must be 0 (greedy) or in [{lo}, {hi}], got {t}"
            )
        top_p = _real("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {top_p}")
        stop = self.stop
        if isinstance(stop, str) or not isinstance(stop, (list, tuple)):
            raise ValueError(
                f"SamplingParams.stop must be a list of strings, got {type(stop).__name__}"
            )
        if len(stop) > MAX_STOP:
            raise ValueError(f"SamplingParams.stop has {len(stop)} strings; at most {MAX_STOP}")
        for x in stop:
            if not isinstance(x, str) or not x or len(x) > MAX_STOP_CHARS:
                raise ValueError(
                    f"SamplingParams.stop must hold non-empty strings of at most "
                    f"{MAX_STOP_CHARS} characters, got {str(x)[:40]!r}"
                )
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(
                f"SamplingParams.stop_token_ids must be a list of ints, got {type(ids).__name__}"
            )
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"SamplingParams.stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS}"
            )
        grammar = self.constraint
        if grammar is not None and (
            not isinstance(grammar, str)
            or not grammar.strip()
            or len(grammar) > MAX_CONSTRAINT_CHARS
        ):
            raise ValueError(
                f"SamplingParams.constraint must be None or a non-empty grammar string of at "
                f"most {MAX_CONSTRAINT_CHARS} characters, got {type(grammar).__name__}"
            )
        return {
            "temperature": t,
            "top_p": top_p,
            "top_k": _int("top_k", self.top_k, -1, INT32_MAX),
            "max_tokens": _int("max_tokens", self.max_tokens, 1, INT32_MAX),
            "stop": tuple(stop),
            "stop_token_ids": tuple(_int("stop_token_ids", i, 0, INT32_MAX) for i in ids),
            "seed": None if self.seed is None else _int("seed", self.seed, -(2**63), 2**64 - 1),
            "top_logprobs": _int("top_logprobs", self.top_logprobs, 0, INT32_MAX),
            "constraint": grammar,
            "adapter": check_adapter_name(self.adapter, "SamplingParams.adapter"),
        }

    def replace(self, **kw) -> SamplingParams:
        return dataclasses.replace(self, **kw)


@dataclasses.dataclass
class SampleResult:
    """One sampled continuation; see the module docstring for the meaning.

    top_logprobs[i] lists (token_id, logprob) pairs, best first, for output
    position i (None unless asked for). routed_experts (mixture-of-experts
    models on the JaxSampler): the experts each token of prompt + output went
    to, as `Completion.routed_experts` stores them (`trace.routing`; -1 where
    not recorded: a reused prompt prefix, the last output token); None
    otherwise. The endpoint copies it into the trace. output_versions[i]: the
    policy version that sampled output_ids[i] (None: all `policy_version`;
    see the module docstring and `token_versions`).
    """

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str
    policy_version: int
    cached_tokens: int = 0
    top_logprobs: list[list[tuple[int, float]]] | None = None
    routed_experts: str | None = None
    output_versions: list[int] | None = None

    def __post_init__(self):
        if len(self.output_logprobs) != len(self.output_ids):
            raise ValueError(
                f"SampleResult: {len(self.output_logprobs)} logprobs for "
                f"{len(self.output_ids)} output ids"
            )
        if self.output_versions is not None and len(self.output_versions) != len(self.output_ids):
            raise ValueError(
                f"SampleResult: output_versions has {len(self.output_versions)} entries "
                f"for {len(self.output_ids)} output ids"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"SampleResult.finish_reason must be one of {FINISH_REASONS}, "
                f"got {self.finish_reason!r}"
            )
        if self.top_logprobs is not None and len(self.top_logprobs) != len(self.output_ids):
            raise ValueError(
                f"SampleResult: top_logprobs has {len(self.top_logprobs)} rows for "
                f"{len(self.output_ids)} output ids"
            )

    def token_versions(self) -> list[int]:
        """The policy version of each output token (`output_versions`, or
        `policy_version` for every token when that is None)."""
        if self.output_versions is None:
            return [int(self.policy_version)] * len(self.output_ids)
        return [int(v) for v in self.output_versions]


@runtime_checkable
class Sampler(Protocol):
    """Token ids in, token ids + log-probs out. See the module docstring."""

    @property
    def policy_version(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        on_tokens: OnTokens | None = None,
    ) -> SampleResult: ...

    def load_weights(self, step: int | None = None) -> int: ...


def check_prompt(
    prompt_ids: Sequence[int], max_context: int, vocab_size: int | None = None
) -> None:
    """Raises the protocol's errors for a prompt a sampler cannot take."""
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty; a sampler needs at least one prompt token")
    if len(prompt_ids) >= max_context:
        raise ContextLengthError(
            f"prompt has {len(prompt_ids)} tokens but the sampler's context holds "
            f"{max_context} (prompt + at least one output token)"
        )
    if vocab_size is not None:
        bad = [t for t in prompt_ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise ValueError(
                f"prompt_ids has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
            )


def truncate_at_stop(
    result: SampleResult, stop: Sequence[str], decode: Callable[[list[int]], str]
) -> tuple[SampleResult, str | None]:
    """Cuts `result` after the token whose text completes the first stop string.

    Returns (result, matched stop string or None). Tokens after the one that
    completed the earliest stop string are dropped (as if sampling had stopped
    there) and finish_reason becomes "stop". A no-op when nothing matches.
    """
    if not stop or not result.output_ids:
        return result, None
    full = decode(result.output_ids)
    hits = [(full.find(s) + len(s), s) for s in stop if s in full]  # (end, stop)
    if not hits:
        return result, None
    _, matched = min(hits)
    # Smallest token prefix whose text contains the stop string (monotone in k).
    lo, hi = 1, len(result.output_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if matched in decode(result.output_ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    keep = lo
    top = result.top_logprobs[:keep] if result.top_logprobs is not None else None
    versions = result.output_versions
    if versions is not None:
        versions = list(versions[:keep])
        if all(v == result.policy_version for v in versions):
            versions = None
    routed = result.routed_experts
    if routed is not None:  # covers prompt + output: keep prompt + the kept tokens
        ids = decode_routing(routed)
        routed = encode_routing(ids[: len(ids) - len(result.output_ids) + keep])
    return dataclasses.replace(
        result,
        output_ids=list(result.output_ids[:keep]),
        output_logprobs=list(result.output_logprobs[:keep]),
        finish_reason="stop",
        top_logprobs=top,
        routed_experts=routed,
        output_versions=versions,
    ), matched
