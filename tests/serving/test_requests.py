"""Request bodies: strict JSON and OpenAI request validation (every field)."""

import pytest

from ac2_jax.serving.core import requests as rq
from ac2_jax.serving.core.errors import APIError


def body(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


TOOLS = [{"type": "function", "function": {"name": "f"}}]


def test_parse_chat_request_fields():
    req = rq.parse_chat_request(body(
        n=2, max_completion_tokens=7, max_tokens=99, temperature=0, top_p=0.5, stop="END",
        seed=3, logprobs=True, top_logprobs=2, stream=True,
        stream_options={"include_usage": True}, agent="compactor", user="end-user-7",
        metadata={"team": "x"}, tools=TOOLS, tool_choice="auto", parallel_tool_calls=False,
        response_format={"type": "text"}, logit_bias={}, presence_penalty=0,
        frequency_penalty=None, functions=None))
    assert (req.n, req.max_tokens, req.temperature, req.top_p) == (2, 7, 0.0, 0.5)
    assert req.stop == ("END",) and req.seed == 3 and req.logprobs and req.top_logprobs == 2
    assert req.stream and req.include_usage and req.agent == "compactor"
    assert req.tools[0]["function"]["name"] == "f" and req.parse_tools


def test_user_is_never_the_agent_label():
    assert rq.parse_chat_request(body(user="sub:1")).agent is None
    assert rq.parse_chat_request(body()).agent is None


def test_messages_are_normalized():
    msgs = rq.normalize_messages([
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
    ({"n": 0}, "n"), ({"n": "2"}, "n"), ({"n": 65}, "n"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2**40}, "max_tokens"), ({"max_completion_tokens": 1.5},
                                           "max_completion_tokens"),
    ({"temperature": 3}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"stop": 5}, "stop"),
    ({"stop": ["a"] * 17}, "stop"), ({"stop": ["x" * 513]}, "stop"), ({"stop": [""]}, "stop"),
    ({"top_k": 2**40}, "top_k"), ({"top_k": -2}, "top_k"), ({"top_k": 1.0}, "top_k"),
    ({"logprobs": "yes"}, "logprobs"), ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"seed": True}, "seed"), ({"seed": 2**64}, "seed"), ({"seed": -2**63 - 1}, "seed"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"tools": TOOLS * 129}, "tools"),
    ({"metadata": "x"}, "metadata"), ({"metadata": {"agent": "a"}}, "metadata.agent"),
    ({"user": 7}, "user"), ({"agent": ""}, "agent"), ({"agent": "a" * 129}, "agent"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"other": 1}}, "stream_options"),
    ({"logit_bias": {"5": 10}}, "logit_bias"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"frequency_penalty": 9}, "frequency_penalty"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
     "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": "{}"}}}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"), ({"store": True}, "store"),
    ({"temperatur": 0.5}, "temperatur"),
])
def test_bad_chat_requests_name_the_field(kw, param):
    with pytest.raises(APIError) as e:
        rq.parse_chat_request(body(**kw))
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_tool_choice_forms():
    named = {"type": "function", "function": {"name": "f"}}
    assert rq.parse_chat_request(body(tools=TOOLS, tool_choice=named)).forced_tool == "f"
    req = rq.parse_chat_request(body(tools=TOOLS, tool_choice="required"))
    assert req.tool_choice == "required" and req.forced_tool is None and req.parse_tools
    assert not rq.parse_chat_request(body(tools=TOOLS, tool_choice="none")).parse_tools
    assert not rq.parse_chat_request(body(tool_choice="none")).parse_tools


def test_response_format_and_parallel_tool_calls_reach_the_request():
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True,
                                                  "schema": {"type": "integer"}}}
    req = rq.parse_chat_request(body(response_format=fmt, parallel_tool_calls=False))
    assert req.response_format == fmt and req.parallel_tool_calls is False
    assert rq.parse_chat_request(body(response_format={"type": "json_object"})).response_format \
        == {"type": "json_object"}
    assert rq.parse_chat_request(body()).response_format is None


def test_body_must_be_an_object():
    with pytest.raises(APIError, match="JSON object"):
        rq.parse_chat_request([1, 2])


def test_parse_completion_request():
    assert rq.parse_completion_request({"model": "m", "prompt": "hi"}).prompt == "hi"
    assert rq.parse_completion_request({"model": "m", "prompt": [[1, 2]]}).prompt == [1, 2]
    legacy = rq.parse_completion_request({"model": "m", "prompt": "x", "logprobs": 3})
    assert legacy.logprobs and legacy.top_logprobs == 3
    for bad, param in (({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
                       ({"prompt": [1, "x"]}, "prompt"), ({"prompt": "x", "echo": True}, "echo"),
                       ({"prompt": "x", "logprobs": 21}, "logprobs"),
                       ({"prompt": "x", "best_of": 2}, "best_of"),
                       ({"prompt": "x", "tools": TOOLS}, "tools")):
        with pytest.raises(APIError) as e:
            rq.parse_completion_request({"model": "m", **bad})
        assert e.value.param == param


@pytest.mark.parametrize("raw, code", [
    (b'{"a": NaN}', "invalid_json"), (b'{"a": Infinity}', "invalid_json"),
    (b'{"a": -Infinity}', "invalid_json"), (b'{"a": 1', "invalid_json"),
    (b'{"a": "\xff"}', "invalid_encoding"), ('{"a": 1}'.encode("utf-16"), "invalid_encoding"),
    (b"[" * 65 + b"]" * 65, "json_too_deep"), (b"[" * 100_000 + b"]" * 100_000, "json_too_deep"),
])
def test_strict_json_refuses(raw, code):
    with pytest.raises(APIError) as e:
        rq.loads_strict(raw)
    assert e.value.status == 400 and e.value.code == code


def test_strict_json_accepts_the_limit():
    assert rq.loads_strict(b"[" * 64 + b"]" * 64, max_depth=64)
    assert rq.loads_strict('{"a": "é", "b": 1e300}'.encode()) == {"a": "é", "b": 1e300}
