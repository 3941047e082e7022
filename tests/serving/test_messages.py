"""POST /v1/messages (the Anthropic Messages API) over real HTTP with the official
`anthropic` SDK.

The sampler is the real JaxSampler over the tiny Decoder fitted to the scripted
3-turn tool conversation (tests/support/serving_helpers.py), so greedy decoding holds that
conversation through Anthropic's API too, and the trace is checked token by token
against the chat template rendered by hand. `GatedSampler` (a test double of the
Sampler protocol) only shows an error arriving mid-stream.
"""

import asyncio
import json
import ssl
import threading

import anthropic
import httpx
import numpy as np
import openai
import pytest

from ac2_jax.sampling import SamplerError
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.serving.app import build_app
from ac2_jax.serving.core.splice import TurnMemory, build_prompt_ids
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.text import parse_tool_calls
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.trace import TraceStore
from tests.support.serving_helpers import (
    SYSTEM,
    TOOLS,
    TURNS,
    USER,
    add_tool,
    fit_tiny_model,
    forward_logprobs,
    scripted_sequence,
)

ADMIN = "sk-admin-messages"
MAX_CONTEXT = 512
WAIT_S = 300  # a generous bound on client waits; never asserted on
# One CA bundle for the module's HTTP clients: a default httpx client (an SDK client's
# too) loads its own (~30 ms of CPU, even for http://).
SSL = ssl.create_default_context()
# The scripted conversation's tool, as Anthropic clients define it.
A_TOOLS = [{"name": "add", "description": "Add two integers.",
            "input_schema": TOOLS[0]["function"]["parameters"]}]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("messages")
    tok = build_tiny_tokenizer(str(tmp / "tok"))
    model = fit_tiny_model(tok)
    sampler = JaxSampler(model, max_context=MAX_CONTEXT, max_batch=4, min_batch=4,
                         min_cache_len=MAX_CONTEXT, prefill_chunk=32, min_prefill_rows=4,
                         eos_token_ids=tok.stop_token_ids, tokenizer=tok)
    store = TraceStore(str(tmp / "traces.jsonl"))
    url, stop = serve_in_thread(build_app(sampler, tok, admin_key=ADMIN, trace_store=store,
                                          model_name="tiny"))
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"},
                         timeout=WAIT_S)
    yield dict(tok=tok, model=model, url=url, admin=admin)
    admin.close()
    stop()
    sampler.close()


def create(env, task_id):
    r = env["admin"].post("/v1/rollouts", json={"task_id": task_id})
    assert r.status_code == 200, r.text
    return r.json()


def claude(url, key):
    """The Anthropic SDK against the endpoint at `url` (the server root)."""
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=WAIT_S,
                               http_client=anthropic.DefaultHttpxClient(verify=SSL))


def rollout_clients(info):
    root = info["base_url"].removesuffix("/v1")
    return claude(root, info["api_key"]), openai.OpenAI(
        base_url=info["base_url"], api_key=info["api_key"], max_retries=0, timeout=WAIT_S,
        http_client=httpx.Client(verify=SSL))


def trace_of(env, info):
    return env["admin"].get(f"/v1/rollouts/{info['rollout_id']}/trace").json()


# The SDK (2.x) has no parameter for temperature, top_p or top_k: they go in extra_body.
GREEDY = {"extra_body": {"temperature": 0}}


def ask(client, messages, **kw):
    """One turn of the scripted conversation, greedy."""
    kw = dict(model="tiny", system=SYSTEM["content"], tools=A_TOOLS, messages=messages,
              max_tokens=64, **GREEDY) | kw
    return client.messages.create(**kw)


def answered(messages, content):
    """`messages` + the assistant's `content` (+ the results of its tool calls)."""
    out = messages + [{"role": "assistant", "content": content}]
    results = [{"type": "tool_result", "tool_use_id": b.id,
                "content": add_tool(json.dumps(b.input))} for b in content if b.type == "tool_use"]
    return out + ([{"role": "user", "content": results}] if results else [])


def reference_completions(tok):
    """(prompt_ids, output_ids) of each scripted turn, rendered by hand as a Chat
    Completions client's conversation (the outputs remembered, as the endpoint splices)."""
    memory, messages, out = TurnMemory(), [SYSTEM, USER], []
    for text, result in TURNS:
        prompt, _ = build_prompt_ids(tok, messages, TOOLS, memory)
        output = tok.encode(text) + [tok.eos_token_id]
        out.append((prompt, output))
        content, calls = parse_tool_calls(text)
        memory.remember(content, calls, output)
        messages = messages + [{"role": "assistant", "content": content or None,
                                "tool_calls": calls or None}]
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": result} for c in calls]
    return out


def check_scripted_episode(env, trace, request_ids):
    """One episode: the scripted conversation, each completion as built by hand,
    recorded under the ids the clients saw; sampled logprobs = a forward pass (1e-4)."""
    (episode,) = trace["episodes"]
    comps = episode["completions"]
    assert [(c["prompt_ids"], c["output_ids"]) for c in comps] == reference_completions(
        env["tok"])
    assert [c["request_id"] for c in comps] == request_ids
    tokens, mask = scripted_sequence(env["tok"])
    assert episode["token_ids"] == tokens and episode["loss_mask"] == mask
    lp, m = np.asarray(episode["sampler_logprobs"]), np.asarray(mask) == 1
    np.testing.assert_allclose(lp[m], forward_logprobs(env["model"], tokens)[m], atol=1e-4)


def test_each_api_gets_its_base_url_from_the_create_call(env):
    # Issue 68, finding 7: the anthropic client given the rollout's `base_url` (the
    # OpenAI one, ending in /v1) asked for /v1/v1/messages and got a 404. The create
    # call returns a base URL per API; each official client works with its own as is.
    info = create(env, "calc-urls")
    assert info["base_url"] == env["url"] + "/v1"
    assert info["anthropic_base_url"] == env["url"]
    client = anthropic.Anthropic(base_url=info["anthropic_base_url"], api_key=info["api_key"],
                                 max_retries=0, timeout=WAIT_S,
                                 http_client=anthropic.DefaultHttpxClient(verify=SSL))
    resp = ask(client, [{"role": "user", "content": USER["content"]}])
    assert resp.id.startswith("msg_") and resp.content
    chat = openai.OpenAI(base_url=info["base_url"], api_key=info["api_key"], max_retries=0,
                         timeout=WAIT_S, http_client=httpx.Client(verify=SSL)).chat.completions.create(
        model="tiny", messages=[SYSTEM, USER], max_tokens=4, temperature=0)
    assert chat.choices[0].message is not None
    trace = trace_of(env, info)
    assert len(trace["episodes"]) >= 1


def test_a_tool_conversation_through_messages_is_one_episode(env):
    info = create(env, "calc-anthropic")
    client, _ = rollout_clients(info)
    messages, responses = [{"role": "user", "content": USER["content"]}], []
    for _ in TURNS:
        resp = ask(client, messages)
        responses.append(resp)
        messages = answered(messages, resp.content)
    for resp, (text, result) in zip(responses, TURNS):
        assert resp.id.startswith("msg_") and resp.model == "tiny" and resp.role == "assistant"
        if result is not None:
            (block,) = resp.content
            call = json.loads(text.split("\n")[1])
            assert resp.stop_reason == "tool_use" and block.type == "tool_use"
            assert block.id.startswith("toolu_") and block.name == call["name"]
            assert block.input == call["arguments"]
        else:
            assert resp.stop_reason == "end_turn" and resp.stop_sequence is None
            assert [(b.type, b.text) for b in resp.content] == [("text", text)]
    check_scripted_episode(env, trace_of(env, info), [r.id for r in responses])
    # count_tokens renders as the answer did: its prompt, prefix-cache reuse included.
    last = responses[-1].usage
    counted = client.messages.count_tokens(model="tiny", system=SYSTEM["content"],
                                           tools=A_TOOLS, messages=messages[:-1])
    prompt = reference_completions(env["tok"])[-1][0]
    assert counted.input_tokens == len(prompt) == (
        last.input_tokens + last.cache_read_input_tokens + last.cache_creation_input_tokens)
    assert last.output_tokens == len(env["tok"].encode(TURNS[-1][0])) + 1  # and the EOS


def test_switching_between_messages_and_chat_completions_stays_one_episode(env):
    info = create(env, "calc-switch")
    claude_client, openai_client = rollout_clients(info)
    first = ask(claude_client, [{"role": "user", "content": USER["content"]}])
    (use,) = first.content
    chat = [SYSTEM, USER,
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": use.id, "type": "function",
                "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
            {"role": "tool", "tool_call_id": use.id, "content": add_tool(json.dumps(use.input))}]
    second = openai_client.chat.completions.create(model="tiny", messages=chat, tools=TOOLS,
                                                   temperature=0, max_tokens=64)
    (call,) = second.choices[0].message.tool_calls
    second_use = {"type": "tool_use", "id": call.id, "name": call.function.name,
                  "input": json.loads(call.function.arguments)}
    messages = [{"role": "user", "content": USER["content"]},
                {"role": "assistant", "content": first.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                              "content": add_tool(json.dumps(use.input))}]},
                {"role": "assistant", "content": [second_use]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": add_tool(call.function.arguments)}]}]
    third = ask(claude_client, messages)
    assert third.content[0].text == TURNS[2][0]
    check_scripted_episode(env, trace_of(env, info), [first.id, second.id, third.id])


def comparable(message):
    """A Message without what differs between two answers of the same tokens: the
    ids, and how the prompt splits into cached and uncached tokens."""
    d = message.model_dump()
    u = d.pop("usage")
    for block in d["content"]:
        if block["type"] == "tool_use":
            assert block.pop("id").startswith("toolu_")
    assert d.pop("id").startswith("msg_")
    return d, u["input_tokens"] + u["cache_read_input_tokens"], u["output_tokens"]


def outputs_by_request(trace):
    return {c["request_id"]: c["output_ids"] for e in trace["episodes"]
            for c in e["completions"]}


def test_streamed_and_plain_answers_are_the_same_tokens(env):
    info = create(env, "stream")
    client, _ = rollout_clients(info)
    first = [{"role": "user", "content": USER["content"]}]
    asks = [  # a tool call (greedy), seeded sampled text, and text cut by a stop sequence
        dict(system=SYSTEM["content"], tools=A_TOOLS, messages=first, max_tokens=64, **GREEDY),
        dict(messages=[{"role": "user", "content": "tell me a story"}], max_tokens=24,
             extra_body={"temperature": 1.0, "seed": 7}),
    ]
    plain_text = client.messages.create(model="tiny", **asks[1]).content[0].text
    stop = plain_text.strip().split()[2]
    asks.append(dict(asks[1], stop_sequences=[stop]))
    ids = []
    for kw in asks:
        plain = client.messages.create(model="tiny", **kw)
        with client.messages.stream(model="tiny", **kw) as stream:
            streamed = stream.get_final_message()
        assert comparable(streamed) == comparable(plain)
        ids.append((plain.id, streamed.id))
        if "stop_sequences" in kw:
            assert plain.stop_reason == "stop_sequence" and plain.stop_sequence == stop
            assert plain.content[0].text == plain_text[:plain_text.find(stop)]
        elif "tools" in kw:
            assert plain.stop_reason == "tool_use" and plain.content[0].input == {"a": 3, "b": 4}
        else:
            assert plain.stop_reason in ("end_turn", "max_tokens") and plain.content[0].text
    outputs = outputs_by_request(trace_of(env, info))
    assert all(outputs[a] == outputs[b] for a, b in ids)  # recorded under the ids seen
    # The raw stream: Anthropic's event sequence, with a ping after message_start.
    with httpx.stream("POST", env["url"] + "/v1/messages", timeout=WAIT_S, verify=SSL,
                      headers={"x-api-key": info["api_key"]},
                      json={"model": "tiny", "stream": True, "temperature": 0,
                            **{k: v for k, v in asks[0].items() if k != "extra_body"}}) as r:
        names = [line.removeprefix("event: ") for line in r.iter_lines()
                 if line.startswith("event: ")]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]


def seen(anthropic_message=None, chat_message=None):
    """(text, [(tool, arguments)]) of an answer through either API."""
    if anthropic_message is not None:
        text = "".join(b.text for b in anthropic_message.content if b.type == "text")
        return text, [(b.name, b.input) for b in anthropic_message.content if b.type == "tool_use"]
    return chat_message.content or "", [(c.function.name, json.loads(c.function.arguments))
                                        for c in chat_message.tool_calls or ()]


def test_tool_choice_is_chat_completions_tool_choice_and_count_tokens_counts_it(env):
    info = create(env, "tool-choice")
    client, chat = rollout_clients(info)
    messages = [{"role": "user", "content": USER["content"]}]
    choices = [  # Anthropic's tool_choice, Chat Completions' fields for the same
        ({"type": "any"}, {"tool_choice": "required"}),
        ({"type": "any", "disable_parallel_tool_use": True},
         {"tool_choice": "required", "parallel_tool_calls": False}),
        ({"type": "tool", "name": "add"},
         {"tool_choice": {"type": "function", "function": {"name": "add"}}}),
        ({"type": "auto", "disable_parallel_tool_use": True},
         {"tool_choice": "auto", "parallel_tool_calls": False}),
        ({"type": "none"}, {"tool_choice": "none"}),
    ]
    pairs = []
    for anthropic_choice, chat_choice in choices:
        resp = ask(client, messages, tool_choice=anthropic_choice)
        ref = chat.chat.completions.create(model="tiny", messages=[SYSTEM, USER], tools=TOOLS,
                                           temperature=0, max_tokens=64, **chat_choice)
        assert seen(resp) == seen(chat_message=ref.choices[0].message)
        pairs.append((resp.id, ref.id))
        u = resp.usage
        assert u.input_tokens + u.cache_read_input_tokens == ref.usage.prompt_tokens
        assert u.output_tokens == ref.usage.completion_tokens
        counted = client.messages.count_tokens(model="tiny", system=SYSTEM["content"],
                                               tools=A_TOOLS, messages=messages,
                                               tool_choice=anthropic_choice)
        assert counted.input_tokens == ref.usage.prompt_tokens
    # "none" leaves the scripted call as text.
    assert seen(resp) == (TURNS[0][0], []) and resp.stop_reason == "end_turn"
    outputs = outputs_by_request(trace_of(env, info))  # the same tokens, both recorded
    assert all(outputs[a] == outputs[b] for a, b in pairs)


USER_MSG = {"role": "user", "content": "What is 3 + 4?"}
HISTORY = [  # a tool call and its result, with the optional fields clients send
    {"role": "user", "content": [{"type": "text", "text": "What is 3 + 4?", "citations": None,
                                  "cache_control": {"type": "ephemeral"}}]},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Let me add."},
        {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 3, "b": 4},
         "cache_control": {"type": "ephemeral", "ttl": "5m"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
         "content": [{"type": "text", "text": "overflow"}], "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Go on."}]},
]
BAD_TOOL_RESULT = [HISTORY[0], HISTORY[1], {"role": "user", "content": [
    {"type": "tool_result", "tool_use_id": "toolu_1",
     "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": "AAAA"}}]}]}]
IMAGE = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
DOCUMENT = {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                           "data": "x"}}
# (body changes, the param a 400 names, or None when the field is accepted)
FIELDS = {
    "system string": ({"system": "Be brief."}, None),
    "system blocks, cache_control": ({"system": [{"type": "text", "text": "Be brief.",
                                                  "cache_control": {"type": "ephemeral",
                                                                    "ttl": "1h"}}]}, None),
    "history with optional block fields": ({"messages": HISTORY, "tools": A_TOOLS}, None),
    "tools with cache_control and type custom": ({"tools": [
        dict(A_TOOLS[0], type="custom", cache_control={"type": "ephemeral"})]}, None),
    "tool_choice none without tools": ({"tool_choice": {"type": "none"}}, None),
    "blocks as the SDK dumps them": ({"tools": A_TOOLS, "messages": [
        USER_MSG, {"role": "assistant", "content": [
            {"type": "text", "text": "Adding.", "citations": None},
            {"type": "tool_use", "id": "toolu_2", "name": "add", "input": {"a": 3, "b": 4},
             "caller": {"type": "direct"}, "toolset_name": None}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2",
                                      "content": "7"}]}]}, None),
    "toolset_name": ({"messages": [USER_MSG, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "add", "input": {}, "toolset_name": "mcp"}]},
        USER_MSG]}, "messages[1].content[0].toolset_name"),
    "metadata.user_id": ({"metadata": {"user_id": "user-7"}}, None),
    "stop_sequences": ({"stop_sequences": ["\n\n", "END"]}, None),
    "temperature 0": ({"temperature": 0}, None),
    "temperature 1": ({"temperature": 1.0}, None),
    "top_p": ({"top_p": 0.9}, None),
    "top_k": ({"top_k": 5}, None),
    "top_k 0 (off)": ({"top_k": 0}, None),
    "stream false": ({"stream": False}, None),
    "thinking disabled": ({"thinking": {"type": "disabled"}}, None),
    "top-level cache_control": ({"cache_control": {"type": "ephemeral"}}, None),
    "service_tier auto": ({"service_tier": "auto"}, None),
    "service_tier standard_only": ({"service_tier": "standard_only"}, None),
    "agent extension": ({"agent": "subagent:x"}, None),
    "seed extension": ({"seed": 3}, None),
    "max_tokens missing": ({"max_tokens": None}, "max_tokens"),
    "max_tokens 0": ({"max_tokens": 0}, "max_tokens"),
    "temperature above 1": ({"temperature": 1.5}, "temperature"),
    "top_p 0": ({"top_p": 0}, "top_p"),
    "top_k negative": ({"top_k": -1}, "top_k"),
    "stop_sequences string": ({"stop_sequences": "END"}, "stop_sequences"),
    "stop_sequences empty string": ({"stop_sequences": [""]}, "stop_sequences[0]"),
    "thinking enabled": ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking"),
    "service_tier priority": ({"service_tier": "priority"}, "service_tier"),
    "metadata unknown key": ({"metadata": {"tags": ["a"]}}, "metadata.tags"),
    "agent empty": ({"agent": ""}, "agent"),
    "image block": ({"messages": [{"role": "user", "content": [IMAGE]}]},
                    "messages[0].content[0].source"),
    "document block": ({"messages": [USER_MSG, {"role": "assistant", "content": "ok"},
                                     {"role": "user", "content": [DOCUMENT]}]},
                       "messages[2].content[0].source"),
    "image in a tool result": ({"messages": BAD_TOOL_RESULT, "tools": A_TOOLS},
                               "messages[2].content[0].content[0].source"),
    "thinking block": ({"messages": [USER_MSG, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": "s"}]}, USER_MSG]},
        "messages[1].content[0].type"),
    "tool_use from the user": ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "add", "input": {}}]}]},
        "messages[0].content[0].type"),
    # A system message in `messages` is a system turn (issue 67: Claude Code 2.1 sends one).
    "system role message": ({"messages": [{"role": "system", "content": "x"}, USER_MSG]}, None),
    "tool role message": ({"messages": [{"role": "tool", "content": "x"}, USER_MSG]},
                          "messages[0].role"),
    "prefill": ({"messages": [USER_MSG, {"role": "assistant", "content": "The"}]}, "messages"),
    "empty content": ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    "citations": ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "citations": [{"type": "char_location"}]}]}]},
        "messages[0].content[0].citations"),
    "cache_control type": ({"system": [{"type": "text", "text": "x",
                                        "cache_control": {"type": "persistent"}}]},
                           "system[0].cache_control.type"),
    "text block without text": ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
                                "messages[0].content[0].text"),
    "server tool": ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                    "tools[0].type"),
    "tool field strict": ({"tools": [dict(A_TOOLS[0], strict=True)]}, "tools[0].strict"),
    "tool name": ({"tools": [dict(A_TOOLS[0], name="add two")]}, "tools[0].name"),
    "tool twice": ({"tools": A_TOOLS * 2}, "tools"),
    "tool schema not an object": ({"tools": [dict(A_TOOLS[0], input_schema={"type": "array"})]},
                                  "tools[0].input_schema"),
    "tool_choice unknown tool": ({"tools": A_TOOLS,
                                  "tool_choice": {"type": "tool", "name": "mul"}}, "tool_choice"),
    "tool_choice any without tools": ({"tool_choice": {"type": "any"}}, "tool_choice"),
    "tool_choice tool without name": ({"tools": A_TOOLS, "tool_choice": {"type": "tool"}},
                                      "tool_choice.name"),
    "OpenAI's n": ({"n": 2}, "n"),
    "OpenAI's stop": ({"stop": ["x"]}, "stop"),
    "container": ({"container": "c-1"}, "container"),
    # What Claude Code sends (observed from a run of the real CLI, 2.1.197).
    "thinking adaptive": ({"thinking": {"type": "adaptive"}}, None),
    "output_config effort": ({"output_config": {"effort": "high"}}, None),
    "output_config bad effort": ({"output_config": {"effort": "extreme"}},
                                 "output_config.effort"),
    "output_config format": ({"output_config": {"format": {
        "type": "json_schema", "schema": {"type": "object"}}}}, None),
    "output_config other format": ({"output_config": {"format": {"type": "regex"}}},
                                   "output_config.format.type"),
    "context_management clear thinking": ({"context_management": {"edits": [
        {"type": "clear_thinking_20251015", "keep": "all"}]}}, None),
    "context_management clear tool uses": ({"context_management": {"edits": [
        {"type": "clear_tool_uses_20250919"}]}}, "context_management.edits[0].type"),
}


@pytest.fixture(scope="module")
def admin_claude(env):
    return claude(env["url"], ADMIN)


@pytest.mark.parametrize("case", list(FIELDS))
def test_every_field_is_accepted_or_refused_naming_it(env, admin_claude, case):
    change, param = FIELDS[case]
    body = {"model": "tiny", "max_tokens": 2, "messages": [USER_MSG]} | change
    body = {k: v for k, v in body.items() if v is not None}
    send = dict(cast_to=anthropic.types.Message, body=body)
    if param is None:
        resp = admin_claude.post("/v1/messages", **send)
        assert resp.type == "message" and resp.usage.output_tokens >= 1
        return
    with pytest.raises(anthropic.BadRequestError) as e:
        admin_claude.post("/v1/messages", **send)
    error = e.value.body
    assert e.value.status_code == 400 and set(error) == {"type", "error"}
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert f"'{param}'" in error["error"]["message"]


def test_count_tokens_takes_the_prompt_fields_only(admin_claude):
    counted = admin_claude.messages.count_tokens(model="tiny", messages=HISTORY, tools=A_TOOLS,
                                                 system="Be brief.")
    assert counted.input_tokens > 0
    for field, value in (("max_tokens", 4), ("stream", True), ("temperature", 0)):
        with pytest.raises(anthropic.BadRequestError, match=f"'{field}' is unknown"):
            admin_claude.post("/v1/messages/count_tokens", cast_to=object, body={
                "model": "tiny", "messages": [USER_MSG], field: value})


def test_auth_and_unknown_model_errors_are_anthropic_shaped(env):
    kw = dict(model="tiny", max_tokens=2, messages=[USER_MSG])
    with pytest.raises(anthropic.AuthenticationError) as e:
        claude(env["url"], "sk-wrong").messages.create(**kw)
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(env["url"] + "/v1/messages", json=kw, verify=SSL)  # no key at all
    assert r.status_code == 401 and r.json() == {"type": "error", "error": {
        "type": "authentication_error", "message": r.json()["error"]["message"]}}
    assert "x-api-key" in r.json()["error"]["message"]
    admin = claude(env["url"], ADMIN).messages
    for call, body in ((admin.create, kw), (admin.count_tokens, {"messages": [USER_MSG]})):
        with pytest.raises(anthropic.NotFoundError) as e:
            call(model="claude-sonnet-4-5", **{k: v for k, v in body.items() if k != "model"})
        assert e.value.body["error"]["type"] == "not_found_error"
        assert "'tiny'" in e.value.body["error"]["message"]


class GatedSampler:
    """Emits `script[0]`, waits for `gate`, then fails with a SamplerError."""

    def __init__(self, script):
        self.script, self.max_context, self.policy_version = script, 256, 0
        self.gate = threading.Event()

    def load_weights(self, step=None):
        return self.policy_version

    async def generate(self, prompt_ids, params, *, on_tokens=None):
        on_tokens(self.script[:1], [-0.5])
        while not self.gate.is_set():
            await asyncio.sleep(0.005)
        raise SamplerError("worker crashed")


def test_an_error_mid_stream_is_an_anthropic_error_event(tmp_path):
    tok = build_tiny_tokenizer(str(tmp_path / "tok"))
    sampler = GatedSampler(tok.encode("one two"))
    url, stop = serve_in_thread(build_app(sampler, tok, admin_key=ADMIN, model_name="tiny"))
    try:
        stream = claude(url, ADMIN).messages.create(model="tiny", max_tokens=8, stream=True,
                                                    messages=[USER_MSG])
        events = iter(stream)
        seen = [next(events).type for _ in range(3)]
        assert seen == ["message_start", "content_block_start", "content_block_delta"]
        sampler.gate.set()  # headers and the first text are out: now the sampler fails
        with pytest.raises(anthropic.APIStatusError) as e:
            list(events)
        assert e.value.body == {"type": "error", "error": {
            "type": "overloaded_error", "message": e.value.body["error"]["message"]}}
        assert "sampler failed" in e.value.body["error"]["message"]
    finally:
        sampler.gate.set()
        stop()


def test_output_config_format_decodes_the_answer_under_its_schema(env):
    """Claude Code's structured output (its title request): the answer is a JSON value
    of the schema, decoded under its grammar and recorded with that grammar."""
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12}},
              "required": ["title"], "additionalProperties": False}
    info = create(env, "structured")
    client, _ = rollout_clients(info)
    for seed in range(3):
        resp = client.messages.create(
            model="tiny", max_tokens=48, messages=[USER_MSG],
            extra_body={"output_config": {"effort": "high", "format": {
                "type": "json_schema", "schema": schema}}, "seed": seed})
        (block,) = resp.content
        value = json.loads(block.text)
        assert set(value) == {"title"} and isinstance(value["title"], str), block.text
        assert resp.stop_reason == "end_turn"
    completions = [c for ep in trace_of(env, info)["episodes"] for c in ep["completions"]]
    assert len(completions) == 3 and all(c.get("constraint") for c in completions)
