"""Token cost and prefix stability of traces.

Cost: prompt tokens split into the cached prefix (what the sampler reported
reusing: `Completion.cached_tokens`) and the uncached rest, plus output
tokens, each at its price per million tokens. Arithmetic is exact
(`fractions.Fraction` dollars from the prices' decimal text), so
0.2M x $0.20 + 1.0M x $2.00 + 0.1M x $8.00 is exactly $2.84.

Prefix stability: for each request (Completion) of an episode, the reusable
tokens are the longest common prefix of its prompt with the previous
request's prompt + output in the same episode (what a prefix cache could
reuse; 0 for an episode's first request). Set beside the sampler's reported
`cached_tokens`, it shows reuse a cache missed, and reuse it found beyond
the episode (e.g. a shared system prompt).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from ac2_jax.trace.types import Episode, Trace

MILLION = 1_000_000


def _price(value, name: str) -> Fraction:
    try:
        x = Fraction(str(value))  # the decimal text: 0.2 -> 1/5 exactly; no inf or NaN
    except (ValueError, ZeroDivisionError):
        x = None
    if x is None or x < 0:
        raise ValueError(
            f"TokenPrices: {name} must be a finite number >= 0 (USD per "
            f"million tokens), got {value!r}"
        )
    return x


@dataclasses.dataclass(frozen=True)
class TokenPrices:
    """USD per million tokens: cached prompt, uncached prompt, output."""

    cached_input: float
    uncached_input: float
    output: float

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _price(getattr(self, f.name), f.name)

    def exact(self) -> tuple[Fraction, Fraction, Fraction]:
        """(cached, uncached, output) prices as exact fractions of a dollar."""
        cached, uncached, output = (
            _price(getattr(self, f.name), f.name) for f in dataclasses.fields(self)
        )
        return cached, uncached, output


@dataclasses.dataclass(frozen=True)
class TokenCost:
    """Dollars per tier and in total, exact (Fractions)."""

    cached_input: Fraction
    uncached_input: Fraction
    output: Fraction

    @property
    def total(self) -> Fraction:
        return self.cached_input + self.uncached_input + self.output

    def __add__(self, other: TokenCost) -> TokenCost:
        return TokenCost(
            self.cached_input + other.cached_input,
            self.uncached_input + other.uncached_input,
            self.output + other.output,
        )

    def to_dict(self) -> dict[str, float]:
        """Floats in dollars (JSON)."""
        return {
            "cached_input": float(self.cached_input),
            "uncached_input": float(self.uncached_input),
            "output": float(self.output),
            "total": float(self.total),
        }


def token_cost(
    cached_tokens: int, uncached_tokens: int, output_tokens: int, prices: TokenPrices
) -> TokenCost:
    """Exact cost of token counts at `prices` (per million)."""
    counts = (cached_tokens, uncached_tokens, output_tokens)
    if any(isinstance(n, bool) or int(n) != n or n < 0 for n in counts):
        raise ValueError(f"token_cost: token counts must be ints >= 0, got {counts}")
    pc, pu, po = prices.exact()
    return TokenCost(
        Fraction(int(cached_tokens)) * pc / MILLION,
        Fraction(int(uncached_tokens)) * pu / MILLION,
        Fraction(int(output_tokens)) * po / MILLION,
    )


def trace_tokens(trace: Trace) -> dict[str, int]:
    """Token counts of a trace's requests: requests, prompt_tokens, cached_tokens
    (as the sampler reported, at most the prompt), uncached_tokens, output_tokens."""
    req = prompt = cached = output = 0
    for ep in trace.episodes:
        for c in ep.completions:
            req += 1
            prompt += len(c.prompt_ids)
            cached += min(int(c.cached_tokens), len(c.prompt_ids))
            output += len(c.output_ids)
    return {
        "requests": req,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "uncached_tokens": prompt - cached,
        "output_tokens": output,
    }


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def request_prefix_reuse(episode: Episode) -> list[dict[str, int]]:
    """Per completion of `episode`: prompt_tokens, reusable_tokens (common prefix
    with the previous completion's prompt + output; 0 for the first) and
    cached_tokens (sampler-reported)."""
    out, prev = [], None
    for c in episode.completions:
        reusable = 0 if prev is None else common_prefix_len(c.prompt_ids, prev)
        out.append(
            {
                "prompt_tokens": len(c.prompt_ids),
                "reusable_tokens": reusable,
                "cached_tokens": min(int(c.cached_tokens), len(c.prompt_ids)),
            }
        )
        prev = list(c.prompt_ids) + list(c.output_ids)
    return out


@dataclasses.dataclass(frozen=True)
class PrefixStats:
    """Prefix reuse summed over requests (of a trace, or of a run: add them).

    reusable_not_cached: sum over requests of max(0, reusable - cached) (reuse
    the sampler missed); cached_beyond_reusable: sum of max(0, cached -
    reusable) (reuse found outside the episode's previous request).
    share_sum: sum of per-request reusable / prompt (for the unweighted mean).
    """

    requests: int = 0
    prompt_tokens: int = 0
    reusable_tokens: int = 0
    cached_tokens: int = 0
    reusable_not_cached: int = 0
    cached_beyond_reusable: int = 0
    share_sum: float = 0.0

    def __add__(self, other: PrefixStats) -> PrefixStats:
        return PrefixStats(
            *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self))
        )

    def to_dict(self) -> dict[str, Any]:
        """The sums, plus reusable_share and cached_share (of prompt tokens) and
        mean_request_share (unweighted over requests); None when undefined."""
        d = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "share_sum"
        }
        p = self.prompt_tokens
        d["reusable_share"] = self.reusable_tokens / p if p else None
        d["cached_share"] = self.cached_tokens / p if p else None
        d["mean_request_share"] = self.share_sum / self.requests if self.requests else None
        return d


def prefix_stats(trace: Trace) -> PrefixStats:
    """Prefix reuse of every request of `trace`, summed."""
    total = PrefixStats()
    for ep in trace.episodes:
        for r in request_prefix_reuse(ep):
            p, u, c = r["prompt_tokens"], r["reusable_tokens"], r["cached_tokens"]
            total = total + PrefixStats(
                1, p, u, c, max(0, u - c), max(0, c - u), u / p if p else 0.0
            )
    return total
