"""serving/core/structured.py: a request's grammar (tool_choice, response_format),
and what it makes of a real JaxSampler's answers over real HTTP with the
official `openai` client: tool calls that always validate, JSON answers that
validate, recorded log-probs equal to the learner's masked re-score.

The model is a tiny random Decoder: its free text is noise, so whatever
parses here was made to parse by the grammar.
"""

import json
import math
import ssl

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ac2_jax.losses import sampling_logits
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.sampling import any_json_grammar, json_schema_grammar, replay_masks, tool_call_grammar
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.serving.app import build_app
from ac2_jax.serving.core import requests as rq
from ac2_jax.serving.core.errors import APIError
from ac2_jax.serving.core.generation import forced_prefix
from ac2_jax.serving.core.structured import request_constraint, response_schema
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.text import Tokenizer
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer

ADMIN = "sk-admin-structured"
# One CA bundle for the module's HTTP clients: a default httpx client (an SDK client's
# too) loads its own (~30 ms of CPU, even for http://), ~40 times here.
SSL = ssl.create_default_context()
CTX = 1024
USER = [{"role": "user", "content": "use the tool"}]
PING = {"type": "function", "function": {"name": "ping"}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                   "b": {"type": "integer", "minimum": 0, "maximum": 9}}}}}


def chat(**kw) -> rq.ChatRequest:
    return rq.parse_chat_request({"model": "tiny", "messages": USER, **kw})


# ------------------------------------------------------------------------------ the mapping


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_request_constraint_maps_each_request_kind_to_one_grammar(tok):
    tools = [ADD, PING]
    assert request_constraint(tok, chat()) is None
    assert request_constraint(tok, chat(tools=tools)) is None  # auto: free text
    assert request_constraint(tok, chat(tools=tools, tool_choice="required")) == \
        tool_call_grammar(tok, tools)
    named = {"type": "function", "function": {"name": "ping"}}
    assert request_constraint(tok, chat(tools=tools, tool_choice=named,
                                        parallel_tool_calls=False)) == \
        tool_call_grammar(tok, tools, "ping", parallel=False)
    obj = {"type": "json_object"}
    schema = {"type": "array", "items": {"type": "integer"}}
    fmt = {"type": "json_schema", "json_schema": {"name": "nums", "schema": schema}}
    assert request_constraint(tok, chat(response_format=obj)) == any_json_grammar()
    assert request_constraint(tok, chat(response_format=fmt)) == json_schema_grammar(schema)
    assert request_constraint(tok, chat(response_format={"type": "text"})) is None
    # Tools the model may call and a JSON answer: either one.
    assert request_constraint(tok, chat(tools=tools, response_format=fmt)) == \
        tool_call_grammar(tok, tools, or_json=schema)
    assert request_constraint(tok, chat(tools=tools, tool_choice="none", response_format=fmt)) \
        == json_schema_grammar(schema)
    # A forced call has no text content for a response_format to shape.
    assert request_constraint(tok, chat(tools=tools, tool_choice="required",
                                        response_format=fmt)) == tool_call_grammar(tok, tools)
    assert response_schema({"type": "json_schema", "json_schema": {"name": "x"}}) == {}
    # With a grammar there is no forced prefix any more.
    assert forced_prefix(tok, chat(tools=tools, tool_choice="required")) == ""


def test_a_format_without_a_grammar_keeps_the_forced_prefix(tok):
    xml = Tokenizer(tok.hf, chat_template=tok.chat_template, special_tokens=tok.special_tokens,
                    tool_parser="qwen3_coder")
    named = {"type": "function", "function": {"name": "ping"}}
    req = chat(tools=[PING], tool_choice=named)
    assert request_constraint(xml, req) is None
    assert forced_prefix(xml, req) == xml.tool_parser.named_opening("ping")
    fmt = {"type": "json_object"}
    assert request_constraint(xml, chat(tools=[PING], tool_choice="none", response_format=fmt)) \
        == any_json_grammar()
    with pytest.raises(APIError) as e:
        request_constraint(xml, chat(tools=[PING], response_format=fmt))
    assert e.value.status == 400 and e.value.param == "response_format"
    assert "qwen3_coder" in e.value.message


def test_schemas_the_grammar_cannot_take_are_400s_naming_the_field(tok):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(APIError) as e:
        request_constraint(tok, chat(response_format=bad))
    assert (e.value.status, e.value.param) == (400, "response_format")
    assert "nonsense" in e.value.message
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
    with pytest.raises(APIError) as e:
        request_constraint(tok, chat(tools=tools, tool_choice="required"))
    assert (e.value.status, e.value.param) == (400, "tools")


# ------------------------------------------------------------------------------ the endpoint


@pytest.fixture(scope="module")
def env(tok, tmp_path_factory):
    cfg = DecoderConfig.tiny(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                             num_heads=2, num_kv_heads=1, head_dim=16,
                             max_position_embeddings=CTX, initializer_range=0.5)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    sampler = JaxSampler(model, max_context=CTX, max_batch=4, min_batch=4, min_cache_len=CTX,
                         prefill_chunk=256, min_prefill_rows=4, eos_token_ids=tok.stop_token_ids,
                         tokenizer=tok, seed=0)
    app = build_app(sampler, tok, admin_key=ADMIN, model_name="tiny")
    url, stop = serve_in_thread(app)
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=300,
                         verify=SSL)
    yield dict(tok=tok, model=model, admin=admin, url=url)
    admin.close()
    stop()
    sampler.close()


def rollout(env):
    info = env["admin"].post("/v1/rollouts", json={"task_id": "t"}).json()
    client = openai.OpenAI(base_url=info["base_url"], api_key=info["api_key"], max_retries=0,
                           http_client=httpx.Client(verify=SSL),
                           timeout=300)
    return info, client


def completions_of(env, info) -> list[dict]:
    trace = env["admin"].get(f"/v1/rollouts/{info['rollout_id']}/trace").json()
    return [c for ep in trace["episodes"] for c in ep["completions"]]


def validates(value, schema) -> bool:
    """The JSON-schema subset the property test draws (jsonschema is not a dependency)."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(validates(v, props[k]) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list)
                and schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", math.inf)
                and all(validates(v, schema["items"]) for v in value))
    if kind == "string":
        return (isinstance(value, str)
                and schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", math.inf))
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", -math.inf) <= value <= schema.get("maximum", math.inf))
    if kind == "boolean":
        return isinstance(value, bool)
    return kind is None


def _leaf():
    string = st.tuples(st.integers(0, 2), st.integers(0, 6)).map(
        lambda t: {"type": "string", "minLength": min(t), "maxLength": max(t)})
    integer = st.tuples(st.integers(-50, 50), st.integers(0, 200)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]})
    enum = st.lists(st.one_of(st.sampled_from(["x", "yes", "paris"]), st.integers(0, 9)),
                    min_size=1, max_size=3, unique=True).map(lambda v: {"enum": v})
    return st.one_of(string, integer, st.just({"type": "boolean"}), enum)


def _prop():
    array = st.tuples(_leaf(), st.integers(0, 2), st.integers(0, 2)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": min(t[1:]),
                   "maxItems": max(t[1:])})
    return st.one_of(_leaf(), array)


@st.composite
def object_schemas(draw):
    names = draw(st.lists(st.sampled_from(["a", "b", "city", "n", "flag", "tags"]),
                          min_size=1, max_size=4, unique=True))
    props = {n: draw(_prop()) for n in names}
    required = [n for n in names if draw(st.booleans())]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schemas=st.lists(object_schemas(), min_size=1, max_size=2),
       seed=st.integers(0, 2**31 - 1), parallel=st.sampled_from([None, False]),
       temperature=st.sampled_from([1.0, 0.7, 0.0]))
def test_tool_choice_required_always_yields_calls_that_validate(env, schemas, seed, parallel,
                                                                 temperature):
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": s}}
             for i, s in enumerate(schemas)]
    _, client = rollout(env)
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    resp = client.chat.completions.create(
        model="tiny", messages=USER, tools=tools, tool_choice="required", max_tokens=400,
        seed=seed, temperature=temperature, **extra)
    (choice,) = resp.choices
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and calls, choice
    assert not choice.message.content  # nothing but calls
    assert parallel is None or len(calls) == 1
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in calls:
        args = json.loads(call.function.arguments)
        assert validates(args, by_name[call.function.name]), (args, by_name)


def test_response_format_json_schema_answers_validate_streamed_or_not(env):
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "ok"],
              "properties": {"city": {"type": "string", "maxLength": 8},
                             "ok": {"type": "boolean"},
                             "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                  "strict": True}}
    info, client = rollout(env)
    resp = client.chat.completions.create(model="tiny", messages=USER, response_format=fmt,
                                          max_tokens=200, n=3, seed=5)
    for choice in resp.choices:
        assert choice.finish_reason == "stop"
        assert validates(json.loads(choice.message.content), schema), choice.message.content
    stream = client.chat.completions.create(model="tiny", messages=USER, response_format=fmt,
                                            max_tokens=200, seed=9, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert validates(json.loads(text), schema), text
    # Any object: unbounded, so a noise model may run out of tokens first; that is
    # "length" (all max_tokens used), never a cut-short answer passed off as done.
    obj = client.chat.completions.create(model="tiny", messages=USER, max_tokens=300, seed=2,
                                         n=4, response_format={"type": "json_object"})
    done = [c for c in obj.choices if c.finish_reason == "stop"]
    assert done and all(isinstance(json.loads(c.message.content), dict) for c in done)
    recorded = completions_of(env, info)[-4:]
    assert sorted(len(c["output_ids"]) for c in recorded if c["finish_reason"] == "length") \
        == [300] * (4 - len(done))


@jax.jit
def _logits(graphdef, state, tokens):
    pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    return nnx.merge(graphdef, state)(tokens, pos, jnp.ones_like(tokens))[0]


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=1.0, top_p=0.9),
                                      dict(temperature=1.0, extra_body={"top_k": 20})])
def test_recorded_logprobs_are_the_learners_masked_rescore(env, sampling):
    """The trace's completion carries its grammar; a full forward of the model,
    replay_masks, sampling_logits and log_softmax give its recorded log-probs
    (fp32, atol 1e-5); a position with one allowed id has log-prob 0."""
    tok, model = env["tok"], env["model"]
    info, client = rollout(env)
    client.chat.completions.create(model="tiny", messages=USER, tools=[ADD, PING],
                                   tool_choice="required", max_tokens=120, seed=11, **sampling)
    (comp,) = completions_of(env, info)
    assert comp["constraint"] == tool_call_grammar(tok, [ADD, PING])
    prompt, out = comp["prompt_ids"], comp["output_ids"]
    logits = np.asarray(_logits(*nnx.split(model), np.asarray([prompt + out], np.int32)))
    logits = logits[len(prompt) - 1:-1]
    masks = replay_masks(comp["constraint"], tok, out, vocab_size=model.config.vocab_size)
    masked = jnp.where(masks, logits, -jnp.inf)
    logp = jax.nn.log_softmax(
        sampling_logits(masked, comp["temperature"], comp["top_k"], comp["top_p"]), axis=-1)
    want = np.asarray(logp)[np.arange(len(out)), out]
    np.testing.assert_allclose(comp["output_logprobs"], want, atol=1e-5, rtol=0)
    forced = np.flatnonzero(masks.sum(-1) == 1)
    assert len(forced) > 5 and all(comp["output_logprobs"][i] == 0.0 for i in forced)
    assert out[-1] == tok.eos_token_id and comp["finish_reason"] == "tool_calls"


def test_a_sampler_without_grammars_keeps_the_forced_opening_and_refuses_json(tok, tmp_path):
    """An endpoint over SGLang (its reproduction, `sglang_fake`): the SGLangSampler
    decodes no grammars (`supports_constraints` False), so tool_choice required opens
    the call in the prompt as before grammars (a 200, no grammar on the request),
    and a JSON output format is a 400 naming it, on every API, before any sampling."""
    from ac2_jax.sampling import SGLangSampler
    from ac2_jax.serving.core.structured import sampler_grammars
    from tests.support.sglang_fake import FakeSGLang

    model = Decoder(DecoderConfig.tiny(vocab_size=tok.vocab_size, max_position_embeddings=512),
                    rngs=nnx.Rngs(0))
    fake = FakeSGLang(model, tok, context_len=512)
    fake_url, stop_fake = serve_in_thread(fake.app)
    sampler = SGLangSampler(fake_url, max_context=512, vocab_size=tok.vocab_size)
    assert not sampler_grammars(sampler)
    url, stop = serve_in_thread(build_app(sampler, tok, admin_key=ADMIN, model_name="tiny"))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key=ADMIN, max_retries=0,
                               http_client=httpx.Client(verify=SSL))
        resp = client.chat.completions.create(model="tiny", messages=USER, tools=[ADD],
                                              tool_choice="required", max_tokens=4)
        assert resp.choices[0].finish_reason in ("length", "stop", "tool_calls")
        (body,) = [b for kind, b in fake.log if kind == "generate"]
        opening = tok.tool_parser.opening
        assert tok.decode(body["input_ids"]).endswith(opening)  # the forced opening
        assert not any(k in body["sampling_params"] for k in ("json_schema", "ebnf", "regex"))
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="tiny", messages=USER, max_tokens=4,
                response_format={"type": "json_schema", "json_schema": {
                    "name": "x", "schema": {"type": "object"}}})
        assert e.value.body["param"] == "response_format"
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="tiny", input="hi", max_output_tokens=4,
                                    text={"format": {"type": "json_object"}})
        assert e.value.body["param"] == "response_format"
        assert len([k for k, _ in fake.log if k == "generate"]) == 1  # refused up front
    finally:
        stop()
        stop_fake()
        fake.close()


# A forced-call turn cut by its token budget (finish_reason "length").

EMPTY = {"type": "object", "properties": {}, "additionalProperties": False}
CUT_ASKS = {  # one seeded forced-call request on each API: fn(client, max_tokens, seed)
    "chat": lambda c, n, seed, **kw: c.chat.completions.create(
        model="tiny", messages=USER, max_tokens=n, seed=seed, tool_choice="required",
        tools=[{"type": "function", "function": {"name": "ping", "parameters": EMPTY}}], **kw),
    "messages": lambda c, n, seed, **kw: c.messages.create(
        model="tiny", messages=USER, max_tokens=n, tool_choice={"type": "any"},
        tools=[{"name": "ping", "input_schema": EMPTY}], extra_body={"seed": seed}, **kw),
    "responses": lambda c, n, seed, **kw: c.responses.create(
        model="tiny", input=USER[0]["content"], max_output_tokens=n, extra_body={"seed": seed},
        tool_choice="required", tools=[{"type": "function", "name": "ping",
                                        "parameters": EMPTY}], **kw),
}


def _cut_points(tok, ids) -> tuple[int, int] | None:
    """(tokens up to the first call's closing tag, tokens that end inside the second
    call), or None when the turn has one call."""
    parser = tok.tool_parser
    ends = [k for k in range(1, len(ids) + 1) if parser.block_close in tok.decode(ids[:k])]
    opens = [k for k in range(1, len(ids) + 1)
             if tok.decode(ids[:k]).count(parser.block_open) == 2]
    closed2 = [k for k in range(1, len(ids) + 1)
               if tok.decode(ids[:k]).count(parser.block_close) == 2]
    if not (ends and opens and closed2):
        return None
    assert opens[0] + 2 < closed2[0]
    return ends[0], opens[0] + 2


def _api_client(api, info):
    if api == "chat" or api == "responses":
        return openai.OpenAI(base_url=info["base_url"], api_key=info["api_key"],
                             max_retries=0, timeout=300, http_client=httpx.Client(verify=SSL))
    import anthropic
    return anthropic.Anthropic(base_url=info["base_url"].removesuffix("/v1"),
                               api_key=info["api_key"], max_retries=0, timeout=300,
                               http_client=anthropic.DefaultHttpxClient(verify=SSL))


def _seen(api, resp) -> tuple[str | None, list[str], str]:
    """(text content, called tool names, why it ended) of one answer."""
    if api == "chat":
        (c,) = resp.choices
        return (c.message.content or None, [t.function.name for t in c.message.tool_calls or []],
                c.finish_reason)
    if api == "messages":
        text = "".join(b.text for b in resp.content if b.type == "text") or None
        return text, [b.name for b in resp.content if b.type == "tool_use"], resp.stop_reason
    text = "".join(p.text for it in resp.output if it.type == "message" for p in it.content)
    return (text or None, [it.name for it in resp.output if it.type == "function_call"],
            resp.status)


@pytest.mark.parametrize("api", sorted(CUT_ASKS))
def test_a_call_cut_by_max_tokens_is_text_or_calls_never_both(env, api):
    """tool_choice required, seeded (the first seed whose turn has two calls): the
    grammar makes calls until the model ends the turn. A budget that ends inside the
    second call leaves a turn that did not parse: its text (markup and all, as sampled) is the content and nothing is a tool call,
    never a call beside the raw markup of the cut one. A budget that ends right after
    the first call's closing tag parsed: one call, no markup in the content. Both
    keep the "length" ending (max_tokens / incomplete). Chat streams the same."""
    tok, ask = env["tok"], CUT_ASKS[api]
    info = env["admin"].post("/v1/rollouts", json={"task_id": f"cut-{api}"}).json()
    client = _api_client(api, info)
    for seed in range(16):
        ask(client, 400, seed)
        ids = completions_of(env, info)[-1]["output_ids"]
        if (points := _cut_points(tok, ids)) is not None:
            break
    assert points is not None, "no seed of 16 made two calls"
    after_first, inside_second = points
    cut = {"chat": "length", "messages": "max_tokens", "responses": "incomplete"}[api]

    text, calls, why = _seen(api, ask(client, inside_second, seed))
    assert (calls, why) == ([], cut)
    sampled = tok.decode(ids[:inside_second], skip_special_tokens=True).strip()
    assert text == sampled and text.startswith(tok.tool_parser.block_open)
    assert completions_of(env, info)[-1]["finish_reason"] == "length"

    text, calls, why = _seen(api, ask(client, after_first, seed))
    assert (text, calls, why) == (None, ["ping"], cut)

    if api == "chat":
        chunks = list(ask(client, inside_second, seed, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert not any(d.tool_calls for d in deltas)
        assert "".join(d.content or "" for d in deltas) == sampled
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
