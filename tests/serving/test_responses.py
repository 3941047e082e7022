"""POST /v1/responses over real HTTP with the official `openai` SDK (`client.responses`).

The sampler is the real JaxSampler over the tiny Decoder fitted to the scripted
3-turn tool conversation (tests/support/serving_helpers.py), so greedy decoding holds the
conversation through the Responses API too, and the recorded episode is checked
token by token against a reference built by hand from the rendered template.
"""

import asyncio
import json
import ssl
import threading

import httpx
import openai
import pytest

from ac2_jax.sampling import SampleResult
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.serving.app import build_app
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from tests.support.serving_helpers import (
    SYSTEM,
    TOOLS,
    TURNS,
    USER,
    add_tool,
    fit_tiny_model,
    scripted_sequence,
)

ADMIN = "sk-admin-responses"
# One CA bundle for the rollouts' openai clients: a default one loads its own (~30 ms of
# CPU, even for http://).
SSL = ssl.create_default_context()
MAX_CONTEXT = 512
INSTRUCTIONS = SYSTEM["content"]
# TOOLS in the Responses form (flat; strict false: arguments are not schema-decoded here).
RTOOLS = [{"type": "function", **t["function"], "strict": False} for t in TOOLS]
ASK = dict(model="tiny", instructions=INSTRUCTIONS, tools=RTOOLS, temperature=0,
           max_output_tokens=64)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("responses")
    tok = build_tiny_tokenizer(str(tmp / "tok"))
    sampler = JaxSampler(fit_tiny_model(tok), max_context=MAX_CONTEXT, max_batch=4, min_batch=4,
                         min_cache_len=MAX_CONTEXT, prefill_chunk=32, min_prefill_rows=4,
                         eos_token_ids=tok.stop_token_ids, tokenizer=tok)
    url, stop = serve_in_thread(build_app(sampler, tok, admin_key=ADMIN, model_name="tiny"))
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=300)
    yield dict(tok=tok, url=url, admin=admin,
               admin_client=openai.OpenAI(base_url=url + "/v1", api_key=ADMIN, max_retries=0))
    admin.close()
    stop()
    sampler.close()


def rollout(env, task="t"):
    info = env["admin"].post("/v1/rollouts", json={"task_id": task}).json()
    client = openai.OpenAI(base_url=info["base_url"], api_key=info["api_key"], max_retries=0,
                           timeout=300, http_client=httpx.Client(verify=SSL))
    return info, client


def episodes(env, info):
    return env["admin"].get(f"/v1/rollouts/{info['rollout_id']}/trace").json()["episodes"]


def reference(tok):
    """(prompt_ids, output_ids) of each scripted turn, by hand: each prompt is the
    previous prompt + output + the template's text after that output (the template
    renders an assistant turn as the generation prompt + what the model wrote)."""
    eos = tok.decode([tok.eos_token_id])
    messages, turns, prompt, said = [SYSTEM, USER], [], None, None
    for text, result in TURNS:
        rendered = tok.apply_chat_template(messages, tools=TOOLS)
        if prompt is None:
            prompt = tok.encode(rendered)
        else:
            assert rendered.startswith(said)
            prompt = turns[-1][0] + turns[-1][1] + tok.encode(rendered[len(said):])
        turns.append((prompt, tok.encode(text) + [tok.eos_token_id]))
        said = rendered + text + eos
        messages = messages + [{"role": "assistant", "content": text},
                               {"role": "tool", "tool_call_id": "c", "content": result}]
    return turns


def check_reference_episode(env, info):
    (ep,) = episodes(env, info)
    ref = reference(env["tok"])
    comps = ep["completions"]
    assert [(c["prompt_ids"], c["output_ids"]) for c in comps] == ref
    tokens, mask = scripted_sequence(env["tok"])
    assert ep["token_ids"] == ref[-1][0] + ref[-1][1] == tokens and ep["loss_mask"] == mask
    return comps


def answer_calls(resp):
    return [{"type": "function_call_output", "call_id": o.call_id, "output": add_tool(o.arguments)}
            for o in resp.output if o.type == "function_call"]


def check_script(responses):
    for resp, (text, result) in zip(responses, TURNS, strict=True):
        assert resp.status == "completed" and resp.id.startswith("resp_")
        if result is None:
            assert [o.type for o in resp.output] == ["message"] and resp.output_text == text
        else:
            (call,) = resp.output
            assert call.type == "function_call" and call.name == "add"
            assert json.loads(call.arguments) == json.loads(text.split("\n")[1])["arguments"]
            assert call.call_id.startswith("call_") and call.id.startswith("fc_")


def test_a_full_input_conversation_is_one_episode_equal_to_the_reference(env):
    info, client = rollout(env, "full-input")
    items, responses = [{"role": "user", "content": USER["content"]}], []
    for _ in TURNS:
        resp = client.responses.create(input=items, store=False, **ASK)
        responses.append(resp)
        items = items + resp.output + answer_calls(resp)  # the SDK's items, sent back
    check_script(responses)
    comps = check_reference_episode(env, info)
    assert [c["request_id"] for c in comps] == [r.id for r in responses]
    assert responses[-1].usage.input_tokens == len(comps[-1]["prompt_ids"])
    assert responses[-1].usage.output_tokens == len(comps[-1]["output_ids"])
    assert responses[-1].usage.output_tokens_details.reasoning_tokens == 0
    with pytest.raises(openai.NotFoundError):  # store=false: nothing to read back
        client.responses.retrieve(responses[0].id)


def test_previous_response_id_chains_give_the_same_episode(env):
    info, client = rollout(env, "chained")
    resp = client.responses.create(input=USER["content"], **ASK)
    responses = [resp]
    for _ in TURNS[1:]:
        resp = client.responses.create(previous_response_id=resp.id, input=answer_calls(resp),
                                       **ASK)
        responses.append(resp)
    check_script(responses)
    check_reference_episode(env, info)
    assert responses[1].previous_response_id == responses[0].id
    got = client.responses.retrieve(responses[1].id)
    assert got.model_dump() == responses[1].model_dump()


def test_switching_to_chat_completions_and_back_stays_one_episode(env):
    info, client = rollout(env, "switch")
    first = client.responses.create(input=[{"role": "user", "content": USER["content"]}], **ASK)
    (call,) = first.output
    messages = [SYSTEM, USER,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call.call_id, "type": "function",
                     "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": add_tool(call.arguments)}]
    second = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                            temperature=0, max_tokens=64)
    (chat_call,) = second.choices[0].message.tool_calls
    items = [{"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": USER["content"]}]},
             {"type": "function_call", "call_id": call.call_id, "name": call.name,
              "arguments": call.arguments},
             *answer_calls(first),
             {"type": "function_call", "call_id": chat_call.id, "name": chat_call.function.name,
              "arguments": chat_call.function.arguments},
             {"type": "function_call_output", "call_id": chat_call.id,
              "output": add_tool(chat_call.function.arguments)}]
    third = client.responses.create(input=items, **ASK)
    assert third.output_text == TURNS[2][0]
    comps = check_reference_episode(env, info)
    assert [c["request_id"] for c in comps] == [first.id, second.id, third.id]


def test_previous_response_id_only_reaches_the_same_keys_stored_responses(env):
    a_info, a = rollout(env, "a")
    _, b = rollout(env, "b")
    admin = env["admin_client"]
    stored = a.responses.create(model="tiny", input="hello", max_output_tokens=2)
    unstored = a.responses.create(model="tiny", input="other", max_output_tokens=2, store=False)
    mine = admin.responses.create(model="tiny", input="hello", max_output_tokens=2)
    ok = a.responses.create(model="tiny", previous_response_id=stored.id, input="more",
                            max_output_tokens=2)
    assert ok.previous_response_id == stored.id
    assert admin.responses.create(model="tiny", previous_response_id=mine.id, input="more",
                                  max_output_tokens=2).status in ("completed", "incomplete")
    for client, rid in ((b, stored.id), (a, unstored.id), (admin, stored.id), (a, mine.id),
                        (a, "resp_nope")):
        with pytest.raises(openai.BadRequestError, match="not found") as e:
            client.responses.create(model="tiny", previous_response_id=rid, input="x",
                                    max_output_tokens=2)
        assert e.value.param == "previous_response_id"
        assert e.value.code == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(stored.id)
    # The refused requests recorded nothing; the chained one continued its episode.
    eps = episodes(env, a_info)
    assert [[c["request_id"] for c in e["completions"]] for e in eps] == [
        [stored.id, ok.id], [unstored.id]]


def test_a_request_shaped_as_codex_sends_it_streams_to_completion(env):
    """The body codex-rs sends (ResponsesApiRequest) for a model it does not know as
    a reasoning one: reasoning null, store false, include [], stream true, no
    temperature; `seed` (our extension) only makes the sample reproducible."""
    info, client = rollout(env, "codex")
    body = {"instructions": INSTRUCTIONS, "tools": RTOOLS, "tool_choice": "auto",
            "parallel_tool_calls": False, "reasoning": None, "store": False, "include": [],
            "prompt_cache_key": "thread-1", "client_metadata": {"x-codex-turn": "1"},
            "input": [{"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": USER["content"]}]}],
            "seed": 0}
    events = list(client.responses.create(model="tiny", stream=True, extra_body=body))
    done = events[-1].response  # sampled at temperature 1: it may run to the context's end
    assert events[-1].type == f"response.{done.status}" and done.status != "failed"
    assert done.store is False and done.tool_choice == "auto" and done.output
    (ep,) = episodes(env, info)
    assert ep["completions"][0]["request_id"] == done.id


def normalized(resp) -> dict:
    """A response without what differs between two identical requests (ids, times,
    prefix-cache hits) and without what the SDK's stream helper adds (`parsed...`)."""
    d = resp.model_dump()
    for key in ("id", "created_at"):
        d.pop(key)
    d["usage"]["input_tokens_details"].pop("cached_tokens")
    for item in d["output"]:
        item.pop("id")
        item.pop("parsed_arguments", None)
        if item["type"] == "function_call":
            item.pop("call_id")
        for part in item.get("content", []):
            part.pop("parsed", None)
    return d


def stream_pieces(events):
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    lps = [lp.logprob for e in events if e.type == "response.output_text.delta"
           for lp in e.logprobs]
    return kinds, text, lps, events[-1].response


@pytest.mark.parametrize("case", ["text", "function_call"])
def test_streamed_and_plain_answers_are_the_same_tokens(env, case):
    info, client = rollout(env, f"stream-{case}")
    items = [{"role": "user", "content": USER["content"]}]
    if case == "text":  # the last turn: the answer, as text
        for i, (text, result) in enumerate(TURNS[:2]):
            args = json.dumps(json.loads(text.split("\n")[1])["arguments"])
            items += [{"type": "function_call", "call_id": f"call_{i}", "name": "add",
                       "arguments": args},
                      {"type": "function_call_output", "call_id": f"call_{i}", "output": result}]
    # Sampled text; the call greedily (the fitted model calls reliably only so).
    ask = dict(ASK, input=items, temperature=1.0 if case == "text" else 0,
               extra_body={"seed": 7}, include=["message.output_text.logprobs"])
    plain = client.responses.create(**ask)
    events = list(client.responses.create(stream=True, **ask))
    with client.responses.stream(**ask) as stream:
        helper_events = list(stream)
        final = stream.get_final_response()
    kinds, text, lps, last = stream_pieces(events)
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{plain.status}"
    assert normalized(last) == normalized(final) == normalized(plain)
    assert [e.type for e in helper_events] == kinds
    if case == "text":
        (msg,) = plain.output
        assert text == plain.output_text and msg.status == plain.status
        assert lps == [lp.logprob for lp in msg.content[0].logprobs]
        assert len(lps) == plain.usage.output_tokens
        done = [e for e in events if e.type == "response.output_text.done"]
        assert [e.text for e in done] == [plain.output_text]
    else:
        (call,) = plain.output
        assert call.type == "function_call"
        args = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        assert args == [call.arguments] and "response.output_text.delta" not in kinds
        assert kinds[2:-1] == ["response.output_item.added",
                               "response.function_call_arguments.delta",
                               "response.function_call_arguments.done",
                               "response.output_item.done"]
    outputs = [c["output_ids"] for e in episodes(env, info) for c in e["completions"]]
    assert len(outputs) == 3 and outputs[0] == outputs[1] == outputs[2]


def test_an_output_cut_at_max_output_tokens_is_incomplete(env):
    ask = dict(ASK, input=USER["content"], max_output_tokens=3)
    plain = env["admin_client"].responses.create(**ask)
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    assert plain.usage.output_tokens == 3 and plain.output[0].status == "incomplete"
    events = list(env["admin_client"].responses.create(stream=True, **ask))
    assert events[-1].type == "response.incomplete"
    assert normalized(events[-1].response) == normalized(plain)


CALL = {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": "{}"}
# Each case: body fields over {"input": "hi", "max_output_tokens": 2}, and the param
# of the 400 (None: accepted).
FIELDS = [
    ({}, None),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "message", "role": "developer",
      "content": [{"type": "input_text", "text": "be brief"}]},
      {"role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}],
       "id": "msg_1", "status": "completed"},
      {**CALL, "id": "fc_1", "status": "completed"},
      {"type": "function_call_output", "call_id": "call_1",
       "output": [{"type": "input_text", "text": "3"}]}]}, None),
    ({"instructions": "Be terse."}, None),
    ({"tools": RTOOLS}, None),
    ({"tools": [{"type": "function", "name": "add"}], "tool_choice": "required"}, None),
    ({"tools": RTOOLS, "tool_choice": {"type": "function", "name": "add"}}, None),
    ({"tools": RTOOLS, "tool_choice": "none"}, None),
    ({"tools": RTOOLS, "tool_choice": "auto", "parallel_tool_calls": False}, None),
    ({"temperature": 0, "top_p": 0.5}, None),
    ({"store": False}, None),
    ({"reasoning": None}, None),
    ({"reasoning": {"effort": "none", "summary": "auto"}}, None),
    ({"text": {"format": {"type": "text"}, "verbosity": "medium"}}, None),
    ({"metadata": {"k": "v"}, "client_metadata": {"a": "b"}}, None),
    ({"user": "u-1", "safety_identifier": "s-1", "prompt_cache_key": "thread-1"}, None),
    ({"truncation": "disabled", "service_tier": "auto"}, None),
    ({"include": ["message.output_text.logprobs"], "top_logprobs": 2}, None),
    ({"include": ["reasoning.encrypted_content"]}, None),
    ({"agent": "sub", "seed": 3}, None),
    ({"background": None, "conversation": None, "max_tool_calls": None}, None),
    ({"tools": [{**RTOOLS[0], "strict": True}], "tool_choice": "required",
      "parallel_tool_calls": False}, None),
    ({"text": {"format": {"type": "json_object"}}}, None),
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"},
                          "strict": True}}}, None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]},
     "input[0].type"),
    ({"input": [{"type": "function_call", "name": "add", "arguments": "{}"}]},
     "input[0].call_id"),
    ({"input": ["hi", {"type": "function_call_output", "call_id": "call_9", "output": "7"}]},
     "input[0]"),
    ({"input": [CALL, {"type": "function_call_output", "call_id": "call_9", "output": "7"}]},
     "input[1].call_id"),
    ({"input": [{"role": "tool", "content": "7"}]}, "input[0].role"),
    ({"input": []}, "input"),
    ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
    # Built-in tools: left out of the prompt under the default builtin_tools "omit" (counted
    # and named; test_harness_apis.py), refused under "refuse". Unknown types are refused.
    *[({"tools": [{"type": kind}]}, None) for kind in (
        "web_search", "web_search_preview", "file_search", "computer_use_preview",
        "code_interpreter", "image_generation", "mcp", "local_shell")],
    *[({"tools": [{"type": kind}]}, "tools[0].type") for kind in ("shell", "custom")],
    ({"tools": [{"type": "namespace", "name": "ns", "tools": []}]}, "tools[0].tools"),
    ({"tools": [{**RTOOLS[0], "strict": True}]}, "tools[0].strict"),  # calls not decoded
    ({"tools": RTOOLS, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"tools": RTOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"reasoning": {"effort": "minimal", "summary": "auto"}}, "reasoning.effort"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "text.format"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"max_tool_calls": 3}, "max_tool_calls"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"metadata": {"agent": "x"}}, "metadata.agent"),
    ({"n": 2}, "n"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"stop": ["x"]}, "stop"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"seed": "x"}, "seed"),
    ({"agent": ""}, "agent"),
    ({"store": "no"}, "store"),
    ({"instructions": 5}, "instructions"),
]


@pytest.mark.parametrize("fields,param", FIELDS, ids=lambda v: json.dumps(v)[:60])
def test_each_field_is_accepted_or_refused_naming_it(env, fields, param):
    client = env["admin_client"]
    body = {"input": "hi", "max_output_tokens": 2, **fields}
    if param is not None:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="tiny", extra_body=body)
        assert e.value.param == param, e.value.message
        return
    resp = client.responses.create(model="tiny", extra_body=body)
    assert resp.object == "response" and resp.usage.output_tokens <= 2
    echoed = {k: v for k, v in fields.items() if k in (
        "instructions", "temperature", "top_p", "store", "metadata", "parallel_tool_calls",
        "top_logprobs", "user", "prompt_cache_key")}
    assert {k: getattr(resp, k) for k in echoed} == echoed
    assert resp.tool_choice == fields.get("tool_choice", "auto") or resp.tool_choice.name == "add"
    assert [t.type for t in resp.tools] == [t["type"] for t in fields.get("tools", [])]
    assert [getattr(t, "name", None) for t in resp.tools] == [
        t.get("name") for t in fields.get("tools", [])]
    if fields.get("include") == ["message.output_text.logprobs"]:
        part = resp.output[0].content[0]
        assert len(part.logprobs) == resp.usage.output_tokens
        assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)


def test_the_model_must_be_the_served_one(env):
    with pytest.raises(openai.NotFoundError) as e:
        env["admin_client"].responses.create(model="gpt-9", input="hi")
    assert e.value.param == "model"



def test_text_format_and_strict_tools_are_decoded_under_their_schema(env):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    resp = env["admin_client"].responses.create(model="tiny", input=USER["content"],
                                                temperature=0, max_output_tokens=48,
                                                text={"format": fmt})
    assert resp.status == "completed" and resp.text.format.name == "answer"
    assert isinstance(json.loads(resp.output_text)["answer"], int)
    resp = env["admin_client"].responses.create(
        input="hello", **dict(ASK, tools=[{**RTOOLS[0], "strict": True}]),
        tool_choice={"type": "function", "name": "add"}, parallel_tool_calls=False)
    (call,) = resp.output
    args = json.loads(call.arguments)
    # Valid under the tool's parameters: a and b required integers (more keys allowed).
    assert call.name == "add" and isinstance(args["a"], int) and isinstance(args["b"], int)


class HeldSampler:
    """The Sampler protocol over a script: its first token at once, the rest once
    `release` is set (so the test orders what happens mid-stream, without timing)."""

    def __init__(self, script: list[int], max_context: int = 256):
        self.script, self.max_context, self.policy_version = script, max_context, 0
        self.release = threading.Event()

    def load_weights(self, step=None):
        return self.policy_version

    async def generate(self, prompt_ids, params, *, on_tokens=None):
        out = self.script[:params.max_tokens]
        for i, t in enumerate(out):
            while i > 0 and not self.release.is_set():
                await asyncio.sleep(0.005)
            if on_tokens is not None:
                on_tokens([t], [-0.5])
        return SampleResult(out, [-0.5] * len(out), "length", self.policy_version)


def test_an_error_once_the_stream_is_open_is_an_error_event(env):
    sampler = HeldSampler(env["tok"].encode("one two three"))
    url, stop = serve_in_thread(build_app(sampler, env["tok"], admin_key=ADMIN,
                                          model_name="tiny"))
    try:
        info = httpx.post(url + "/v1/rollouts", json={"task_id": "err"},
                          headers={"Authorization": f"Bearer {ADMIN}"}).json()
        key = {"Authorization": f"Bearer {info['api_key']}"}
        client = openai.OpenAI(base_url=info["base_url"], api_key=info["api_key"],
                               max_retries=0, timeout=300)
        events = iter(client.responses.create(model="tiny", input="count", stream=True,
                                              max_output_tokens=3))
        assert next(events).type == "response.created"
        # The rollout's own key ends it while its answer is being sampled.
        assert httpx.post(f"{url}/v1/rollouts/{info['rollout_id']}/finish", headers=key,
                          json={}).status_code == 200
        sampler.release.set()
        error, failed = list(events)[-2:]
        assert error.type == "error" and error.code == "rollout_ended_by_key"
        assert failed.type == "response.failed" and failed.response.status == "failed"
        assert failed.response.error.code == "rollout_ended_by_key"
        trace = httpx.get(f"{url}/v1/rollouts/{info['rollout_id']}/trace",
                          headers={"Authorization": f"Bearer {ADMIN}"}).json()
        assert trace["episodes"] == []  # nothing recorded
    finally:
        sampler.release.set()
        stop()
