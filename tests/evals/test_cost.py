"""Token cost in exact arithmetic, and prefix reuse of recorded requests."""

from fractions import Fraction

import pytest

from ac2_jax.evals import (
    PrefixStats,
    TokenCost,
    TokenPrices,
    common_prefix_len,
    prefix_stats,
    request_prefix_reuse,
    token_cost,
    trace_tokens,
)
from ac2_jax.trace import Completion, Episode, Trace

PRICES = TokenPrices(cached_input=0.20, uncached_input=2.00, output=8.00)  # $ per million


def test_cost_of_the_design_example_is_exact():
    """0.2M cached + 1.0M uncached + 0.1M output at $0.20 / $2.00 / $8.00 per million:
    $0.04 + $2.00 + $0.80 = $2.84, exactly (Fractions, no float rounding)."""
    c = token_cost(200_000, 1_000_000, 100_000, PRICES)
    assert (c.cached_input, c.uncached_input, c.output) == (
        Fraction(4, 100), Fraction(2), Fraction(80, 100))
    assert c.total == Fraction(284, 100)
    assert c.to_dict() == {"cached_input": 0.04, "uncached_input": 2.0, "output": 0.8,
                           "total": 2.84}
    # Read as 1.0M prompt tokens of which 0.2M cached: $0.04 + $1.60 + $0.80 = $2.44.
    assert token_cost(200_000, 800_000, 100_000, PRICES).total == Fraction(244, 100)


def test_cost_adds_and_scales_exactly():
    one = token_cost(1, 1, 1, PRICES)
    assert one.total == Fraction(1020, 100) / 1_000_000  # $10.20 per million of each
    total = sum((one for _ in range(1000)), TokenCost(Fraction(0), Fraction(0), Fraction(0)))
    assert total.total == Fraction(1020, 100) / 1000  # floats would drift here
    assert token_cost(3, 0, 0, TokenPrices(0.1, 0, 0)).total == Fraction(3, 10_000_000)


def test_bad_prices_and_counts_are_named():
    for bad in (-1.0, float("nan"), float("inf"), "cheap"):
        with pytest.raises(ValueError, match="cached_input"):
            TokenPrices(bad, 1.0, 1.0)
    with pytest.raises(ValueError, match="ints >= 0"):
        token_cost(-1, 0, 0, PRICES)
    with pytest.raises(ValueError, match="ints >= 0"):
        token_cost(1.5, 0, 0, PRICES)


def _completion(prompt, output, cached=0):
    return Completion(prompt_ids=list(prompt), output_ids=list(output),
                      output_logprobs=[0.0] * len(output), cached_tokens=cached)


def _episode():
    return Episode(agent="main", completions=[
        _completion([1, 2, 3], [4, 5], cached=0),
        _completion([1, 2, 3, 4, 5, 6, 7], [8], cached=3),  # append-only: 5 reusable
        _completion([1, 2, 3, 4, 9, 9, 9, 9], [10], cached=6),  # re-rendered after token 4
    ])


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0


def test_request_prefix_reuse_against_the_previous_prompt_and_output():
    reuse = request_prefix_reuse(_episode())
    assert [r["reusable_tokens"] for r in reuse] == [0, 5, 4]
    assert [r["prompt_tokens"] for r in reuse] == [3, 7, 8]
    assert [r["cached_tokens"] for r in reuse] == [0, 3, 6]


def test_prefix_stats_per_trace_and_run():
    other = Episode(agent="sub", completions=[_completion([1, 2], [3], cached=2)])
    trace = Trace(task_id="t", episodes=[_episode(), other])
    s = prefix_stats(trace)
    assert (s.requests, s.prompt_tokens, s.reusable_tokens, s.cached_tokens) == (4, 20, 9, 11)
    assert s.reusable_not_cached == 2      # request 2: 5 reusable, 3 cached
    assert s.cached_beyond_reusable == 4   # request 3: 6 cached, 4 reusable; the sub-agent's 2
    d = s.to_dict()
    assert d["reusable_share"] == pytest.approx(9 / 20)
    assert d["cached_share"] == pytest.approx(11 / 20)
    assert d["mean_request_share"] == pytest.approx((0 + 5 / 7 + 4 / 8 + 0) / 4)
    run = s + s
    assert run.prompt_tokens == 40 and run.to_dict()["reusable_share"] == d["reusable_share"]
    assert PrefixStats().to_dict()["reusable_share"] is None


def test_trace_tokens_split_prompt_into_cached_and_uncached():
    trace = Trace(task_id="t", episodes=[_episode(), Episode(agent="x", completions=[
        _completion([1, 2], [3], cached=5)])])  # reported more than the prompt: capped
    assert trace_tokens(trace) == {"requests": 4, "prompt_tokens": 20, "cached_tokens": 11,
                                   "uncached_tokens": 9, "output_tokens": 5}
