"""OpenAI request parsing and response building."""

import json

import pytest

from ac2_jax.models.tokenizer import build_tiny_tokenizer
from ac2_jax.sampling import SampleResult
from ac2_jax.serving import chat
from ac2_jax.serving.errors import APIError


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def body(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


def test_parse_chat_request_fields():
    req = chat.parse_chat_request(body(
        n=2, max_completion_tokens=7, max_tokens=99, temperature=0, top_p=0.5, stop="END",
        seed=3, logprobs=True, top_logprobs=2, stream=True,
        stream_options={"include_usage": True}, metadata={"agent": "compactor"},
        tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="auto"))
    assert (req.n, req.max_tokens, req.temperature, req.top_p) == (2, 7, 0.0, 0.5)
    assert req.stop == ("END",) and req.seed == 3 and req.logprobs and req.top_logprobs == 2
    assert req.stream and req.include_usage and req.agent == "compactor"
    assert req.tools[0]["function"]["name"] == "f"
    assert chat.parse_chat_request(body(user="sub:1")).agent == "sub:1"
    assert chat.parse_chat_request(body()).agent is None


def test_messages_are_normalized():
    msgs = chat.normalize_messages([
        {"role": "developer", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
        {"role": "user", "content": "q", "refusal": None, "audio": None},
        {"role": "assistant", "content": None, "annotations": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "1"},
    ])
    assert msgs[0] == {"role": "system", "content": "a\nb"}
    assert msgs[1] == {"role": "user", "content": "q"}
    assert "content" not in msgs[2] and msgs[2]["tool_calls"][0]["id"] == "c"
    assert msgs[3] == {"role": "tool", "tool_call_id": "c", "content": "1"}


@pytest.mark.parametrize("kw, param", [
    ({"model": None}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"n": 0}, "n"), ({"n": "2"}, "n"), ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"), ({"stop": 5}, "stop"),
    ({"logprobs": "yes"}, "logprobs"), ({"top_logprobs": 21}, "top_logprobs"),
    ({"seed": True}, "seed"), ({"tools": [{"type": "function"}]}, "tools"),
    ({"metadata": "x"}, "metadata"),
])
def test_bad_chat_requests_name_the_field(kw, param):
    with pytest.raises(APIError) as e:
        chat.parse_chat_request(body(**kw))
    assert e.value.status == 400 and e.value.param == param
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_body_must_be_an_object():
    with pytest.raises(APIError, match="JSON object"):
        chat.parse_chat_request([1, 2])


def test_parse_completion_request():
    assert chat.parse_completion_request({"model": "m", "prompt": "hi"}).prompt == "hi"
    assert chat.parse_completion_request({"model": "m", "prompt": [[1, 2]]}).prompt == [1, 2]
    legacy = chat.parse_completion_request({"model": "m", "prompt": "x", "logprobs": 3})
    assert legacy.logprobs and legacy.top_logprobs == 3
    for bad in ({"prompt": ""}, {"prompt": ["a", "b"]}, {"prompt": [1, "x"]},
                {"prompt": "x", "echo": True}, {"prompt": "x", "logprobs": 21}):
        with pytest.raises(APIError):
            chat.parse_completion_request({"model": "m", **bad})


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


def test_stream_events_end_with_done(tok):
    ids = tok.encode("hi") + [tok.eos_token_id]
    r = SampleResult(ids, [0.0] * len(ids), "stop", 4)
    c = chat.choice_from_result(0, r, None, tok, False)
    req = chat.parse_chat_request(body(stream=True, stream_options={"include_usage": True}))
    events = list(chat.chat_stream_events("m", [c], 5, tok, req, 4))
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert "".join(ch["choices"][0]["delta"].get("content") or ""
                   for ch in chunks if ch["choices"]) == "hi"
    assert chunks[-1]["usage"]["completion_tokens"] == len(ids)
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
