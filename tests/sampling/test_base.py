"""Sampler protocol types: validation, stop-string truncation, prompt checks."""

import pytest

from ac2_jax.sampling import (
    ContextLengthError,
    Sampler,
    SampleResult,
    SamplingParams,
    check_prompt,
    truncate_at_stop,
)
from ac2_jax.sampling.remote.sglang import SGLangSampler

ALPHABET = "abcdefghij"


def decode(ids):
    return "".join(ALPHABET[i] for i in ids)


def result(text, finish="length", top=False):
    ids = [ALPHABET.index(c) for c in text]
    return SampleResult(output_ids=ids, output_logprobs=[-float(i) for i in range(len(ids))],
                        finish_reason=finish, policy_version=3,
                        top_logprobs=[[(i, -0.5)] for i in ids] if top else None)


def test_sampling_params_defaults_and_tuples():
    p = SamplingParams(stop=["x", "yz"], stop_token_ids=[3, 4])
    assert p.stop == ("x", "yz") and p.stop_token_ids == (3, 4)
    assert hash(p) == hash(SamplingParams(stop=("x", "yz"), stop_token_ids=(3, 4)))
    assert p.replace(seed=5).seed == 5 and p.seed is None


@pytest.mark.parametrize("kw, match", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"top_logprobs": -1}, "top_logprobs"), ({"stop": [""]}, "stop"),
])
def test_sampling_params_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_sample_result_validation():
    with pytest.raises(ValueError, match="logprobs"):
        SampleResult([1, 2], [0.0], "stop", 0)
    with pytest.raises(ValueError, match="finish_reason"):
        SampleResult([1], [0.0], "eos", 0)
    with pytest.raises(ValueError, match="top_logprobs"):
        SampleResult([1], [0.0], "stop", 0, top_logprobs=[])


def test_check_prompt():
    check_prompt([1, 2, 3], max_context=4, vocab_size=10)
    with pytest.raises(ValueError, match="empty"):
        check_prompt([], 4)
    with pytest.raises(ContextLengthError, match="4 tokens"):
        check_prompt([1, 2, 3, 4], 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        check_prompt([1, 12], 8, vocab_size=10)


def test_truncate_at_stop_cuts_after_the_completing_token():
    r, matched = truncate_at_stop(result("abcdefg", top=True), ["de", "zz"], decode)
    assert matched == "de"
    assert decode(r.output_ids) == "abcde" and r.finish_reason == "stop"
    assert r.output_logprobs == [0.0, -1.0, -2.0, -3.0, -4.0]
    assert len(r.top_logprobs) == 5 and r.policy_version == 3


def test_truncate_at_stop_picks_the_stop_that_ends_first():
    # "bcdef" starts first but "cd" is complete earlier.
    r, matched = truncate_at_stop(result("abcdefgh"), ["bcdef", "cd"], decode)
    assert matched == "cd" and decode(r.output_ids) == "abcd"


def test_truncate_at_stop_with_multi_character_tokens():
    words = ["he", "llo wo", "rld", "!!"]
    r = SampleResult([0, 1, 2, 3], [0.0] * 4, "length", 0)
    cut, matched = truncate_at_stop(r, ["o w"], lambda ids: "".join(words[i] for i in ids))
    assert matched == "o w" and cut.output_ids == [0, 1]


def test_truncate_at_stop_no_match_is_identity():
    r = result("abc", finish="length")
    assert truncate_at_stop(r, ["x"], decode) == (r, None)
    assert truncate_at_stop(r, [], decode) == (r, None)
    empty = SampleResult([], [], "length", 0)
    assert truncate_at_stop(empty, ["a"], decode) == (empty, None)


def test_sglang_sampler_satisfies_the_protocol():
    s = SGLangSampler("http://127.0.0.1:1", max_context=64)
    assert isinstance(s, Sampler)
    # SGLang refuses input + max_new_tokens >= context_len, so a 64-token
    # context holds at most 63 tokens of prompt + output.
    assert s.policy_version == 0 and s.max_context == 63


@pytest.mark.parametrize("kw, field", [
    ({"top_k": 2**40}, "top_k"), ({"top_k": -2}, "top_k"), ({"top_k": 2.0}, "top_k"),
    ({"top_k": True}, "top_k"), ({"max_tokens": 2**31}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"), ({"max_tokens": False}, "max_tokens"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": 1e-40}, "temperature"), ({"temperature": "1"}, "temperature"),
    ({"temperature": True}, "temperature"), ({"top_p": float("nan")}, "top_p"),
    ({"top_p": True}, "top_p"), ({"top_p": None}, "top_p"),
    ({"seed": 2**64}, "seed"), ({"seed": -2**63 - 1}, "seed"), ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"), ({"top_logprobs": 2**40}, "top_logprobs"),
    ({"top_logprobs": 1.0}, "top_logprobs"), ({"stop": "END"}, "stop"),
    ({"stop": ["x"] * 17}, "stop"), ({"stop": ["x" * 513]}, "stop"), ({"stop": [3]}, "stop"),
    ({"stop": None}, "stop"), ({"stop_token_ids": [1] * 65}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"stop_token_ids": ["3"]}, "stop_token_ids"), ({"stop_token_ids": [1.7]}, "stop_token_ids"),
    ({"stop_token_ids": 3}, "stop_token_ids"),
])
def test_sampling_params_checks_type_range_and_size_of_every_field(kw, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**kw)


def test_sampling_params_accepts_the_edges_and_normalises_types():
    import numpy as np
    p = SamplingParams(temperature=0, top_p=1, top_k=np.int64(2**31 - 1), max_tokens=2**31 - 1,
                       seed=2**64 - 1, stop=["x" * 512] * 16, stop_token_ids=[np.int32(5)] * 64)
    assert type(p.temperature) is float and type(p.top_p) is float
    assert type(p.top_k) is int and p.stop_token_ids == (5,) * 64
    assert SamplingParams(seed=-2**63, temperature=1e-4).seed == -2**63
    # A forced (unvalidated) field is caught again by checked(), as samplers do on admission.
    object.__setattr__(p, "top_k", 2**40)
    with pytest.raises(ValueError, match="SamplingParams.top_k "):
        p.checked()
