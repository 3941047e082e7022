"""OpenAI response building from sampled results."""

import json

import pytest

from ac2_jax.sampling import SampleResult
from ac2_jax.serving.core import chat
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_choice_from_result_drops_eos_cuts_stop_and_parses_tools(tok):
    text = 'ok <tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    ids = tok.encode(text) + [tok.eos_token_id]
    r = SampleResult(ids, [-0.1] * len(ids), "stop", 2)
    c = chat.choice_from_result(0, r, None, tok, parse_tools=True)
    assert c.content == "ok" and c.finish_reason == "tool_calls"
    assert json.loads(c.tool_calls[0]["function"]["arguments"]) == {"a": 1}
    plain = chat.choice_from_result(0, r, None, tok, parse_tools=False)
    assert plain.content == text and plain.tool_calls == [] and plain.finish_reason == "stop"
    only_call = chat.choice_from_result(
        0, SampleResult(ids[2:], [0.0] * (len(ids) - 2), "stop", 0), None, tok, True)
    assert only_call.content is None and only_call.tool_calls

    ids = tok.encode("alpha END beta")
    r = SampleResult(ids, [0.0] * len(ids), "stop", 0)
    c = chat.choice_from_result(1, r, "END", tok, parse_tools=False)
    assert c.text == "alpha " and c.index == 1


def test_logprobs_objects(tok):
    ids = tok.encode("hello world")
    r = SampleResult(ids, [-0.5] * len(ids), "length", 0,
                     top_logprobs=[[(i, -0.5), (0, -3.0)] for i in ids])
    lp = chat.chat_logprobs(tok, r, top_n=1)
    assert [e["token"] for e in lp["content"]] == [tok.decode([i]) for i in ids]
    assert all(len(e["top_logprobs"]) == 1 and e["logprob"] == -0.5 for e in lp["content"])
    assert "".join(e["token"] for e in lp["content"]) == "hello world"
    legacy = chat.completion_logprobs(tok, r, top_n=2)
    assert legacy["token_logprobs"] == [-0.5] * len(ids)
    assert legacy["text_offset"][0] == 0 and len(legacy["top_logprobs"][0]) == 2


def test_a_forced_tool_call_prefix_is_parsed_with_the_output(tok):
    prefix = '<tool_call>\n{"name": "add", "arguments": '
    ids = tok.encode('{"a": 1, "b": 2}}\n</tool_call>') + [tok.eos_token_id]
    r = SampleResult(ids, [-0.1] * len(ids), "stop", 0)
    c = chat.choice_from_result(0, r, None, tok, parse_tools=True, prefix=prefix)
    assert c.finish_reason == "tool_calls" and c.content is None
    assert c.tool_calls[0]["function"]["name"] == "add"
    assert json.loads(c.tool_calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
