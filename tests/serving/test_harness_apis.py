"""What production agent CLIs send with their default settings, over real HTTP with
the official SDKs (`anthropic`, `openai`, `google-genai`) (issue 67).

Claude Code 2.1 sends a mid-conversation system message; Codex 0.17x a `namespace`
tool group and the built-in `web_search` tool; Gemini CLI speaks only the Gemini
API. The sampler is `ScriptedSampler`, a test double of the Sampler protocol that
answers the texts it is given (so a test decides when the model calls a tool,
without fitting a model); the endpoint, template, splice and recording are real.
"""

from __future__ import annotations

import collections
import functools
import json
import ssl

import anthropic
import httpx
import openai
import pytest

from ac2_jax.sampling import SampleResult
from ac2_jax.serving.app import build_app
from ac2_jax.serving.core.splice import TurnMemory, build_prompt_ids
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.text.tiny_tokenizer import TINY_CHAT_TEMPLATE, build_tiny_tokenizer

ADMIN = "sk-admin-harness"
WAIT_S = 120
# One CA bundle for the module's HTTP clients: a default httpx client (each SDK client's
# too) loads its own (~30 ms of CPU, even for http://), ~90 times here.
SSL = ssl.create_default_context()
http_get = functools.partial(httpx.get, verify=SSL)
http_post = functools.partial(httpx.post, verify=SSL)
http_client = functools.partial(httpx.Client, verify=SSL)
GENAI_SSL = {"client_args": {"verify": SSL}, "async_client_args": {"verify": SSL}}


class ScriptedSampler:
    """The Sampler protocol over a script: each request answers the next queued text
    (then "ok"), its tokens + EOS, each with log-prob -0.5."""

    def __init__(self, tok, max_context: int = 4096):
        self.tok, self.max_context, self.policy_version = tok, max_context, 0
        self.queue: collections.deque[str] = collections.deque()
        self.prompts: list[list[int]] = []
        self.params: list = []

    def load_weights(self, step=None):
        return self.policy_version

    async def generate(self, prompt_ids, params, *, on_tokens=None):
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        text = self.queue.popleft() if self.queue else "ok"
        out = (self.tok.encode(text) + [self.tok.eos_token_id])[: params.max_tokens]
        finish = "stop" if out and out[-1] == self.tok.eos_token_id else "length"
        if on_tokens is not None:
            on_tokens(out, [-0.5] * len(out))
        return SampleResult(out, [-0.5] * len(out), finish, self.policy_version)


def serve(tok, sampler, **kw):
    return serve_in_thread(build_app(sampler, tok, admin_key=ADMIN, model_name="tiny", **kw))


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("harness")
    tok = build_tiny_tokenizer(str(tmp / "tok"))
    sampler = ScriptedSampler(tok)
    url, stop = serve(tok, sampler)
    # The same tokenizer with a template that cannot render a system turn after the first.
    strict_tok = build_tiny_tokenizer(str(tmp / "tok2"))
    strict_tok.chat_template = TINY_CHAT_TEMPLATE.replace(
        "{%- elif message.role in ['user', 'system'] %}",
        "{%- elif message.role == 'system' %}{{- raise_exception('System role only first') }}"
        "{%- elif message.role == 'user' %}")
    strict_url, strict_stop = serve(strict_tok, ScriptedSampler(strict_tok))
    refuse_url, refuse_stop = serve(tok, ScriptedSampler(tok), builtin_tools="refuse")
    admin = http_client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"},
                         timeout=WAIT_S)
    yield dict(tok=tok, sampler=sampler, url=url, admin=admin, strict_url=strict_url,
               refuse_url=refuse_url)
    admin.close()
    stop()
    strict_stop()
    refuse_stop()


def create(env, task_id, url=None, **fields):
    r = http_post((url or env["url"]) + "/v1/rollouts", json={"task_id": task_id, **fields},
                   headers={"Authorization": f"Bearer {ADMIN}"}, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return r.json()


def trace_of(env, info, url=None):
    return http_get(f"{url or env['url']}/v1/rollouts/{info['rollout_id']}/trace",
                     headers={"Authorization": f"Bearer {ADMIN}"}, timeout=WAIT_S).json()


def claude(info):
    return anthropic.Anthropic(base_url=info["anthropic_base_url"], api_key=info["api_key"],
                               max_retries=0, timeout=WAIT_S,
                               http_client=anthropic.DefaultHttpxClient(verify=SSL))


# ------------------------------------------------------------------ Anthropic Messages

MID_SYSTEM_BETA = {"anthropic-beta": "mid-conversation-system-2026-04-07"}
AGENT_LISTING = "Available agent types: general-purpose, Explore."


def test_a_mid_conversation_system_message_is_a_system_turn(env):
    """Claude Code 2.1's default request: messages[1] is a system message. It is a
    system turn at its place, rendered by the template and recorded so."""
    info = create(env, "mid-system")
    messages = [{"role": "user", "content": "<context>cwd: /w</context>"},
                {"role": "system", "content": [{"type": "text", "text": AGENT_LISTING}]},
                {"role": "user", "content": "Say hi."}]
    msg = claude(info).messages.create(model="tiny", system="You are Claude Code.",
                                       messages=messages, max_tokens=16,
                                       extra_headers=MID_SYSTEM_BETA)
    assert msg.content[0].text == "ok"
    chat = [{"role": "system", "content": "You are Claude Code."},
            {"role": "user", "content": "<context>cwd: /w</context>"},
            {"role": "system", "content": AGENT_LISTING},
            {"role": "user", "content": "Say hi."}]
    (episode,) = trace_of(env, info)["episodes"]
    (comp,) = episode["completions"]
    assert comp["messages_delta"] == chat and comp["messages_start"] == 0
    assert comp["prompt_ids"] == build_prompt_ids(env["tok"], chat, None, TurnMemory())[0]
    assert "<|im_start|>system\n" + AGENT_LISTING in env["tok"].decode(comp["prompt_ids"])


def test_refused_roles_are_worded_as_anthropic_words_them(env):
    """Claude Code's fallback (resend the system message as user text) fires on a 400
    with "Unexpected role" and "input message role"; so does every refused role."""
    info = create(env, "roles")
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(info).messages.create(model="tiny", max_tokens=8, messages=[
            {"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}])
    assert "Unexpected role" in e.value.message and "input message role" in e.value.message
    assert "messages[1].role" in e.value.message
    # A template that cannot render a system turn mid-conversation: Anthropic's own 400.
    info = create(env, "roles-strict", url=env["strict_url"])
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(info).messages.create(model="tiny", max_tokens=8, messages=[
            {"role": "user", "content": "hi"}, {"role": "system", "content": AGENT_LISTING},
            {"role": "user", "content": "go"}], extra_headers=MID_SYSTEM_BETA)
    assert 'Unexpected role "system"' in e.value.message
    assert "input message role" in e.value.message and "System role only first" in (
        e.value.message)


def test_a_template_error_unrelated_to_the_system_turn_is_not_relabelled(tmp_path):
    """Review: every template 400 of a body holding a system turn was answered as the
    system-role refusal (so Claude Code resent the system text as user text and met the
    real error only then). Now only a template that renders the conversation once the
    system turns are user turns gets that wording."""
    tok = build_tiny_tokenizer(str(tmp_path / "tok"))
    tok.chat_template = TINY_CHAT_TEMPLATE.replace(
        "{%- for message in messages %}",
        "{%- for message in messages %}{%- if 'BOOM' in (message.content | string) %}"
        "{{- raise_exception('cannot render BOOM') }}{%- endif %}", 1)
    url, stop = serve(tok, ScriptedSampler(tok))
    try:
        info = create({"url": url}, "boom", url=url)
        with pytest.raises(anthropic.BadRequestError) as e:
            claude(info).messages.create(model="tiny", max_tokens=8, messages=[
                {"role": "user", "content": "hi"}, {"role": "system", "content": AGENT_LISTING},
                {"role": "user", "content": "BOOM"}], extra_headers=MID_SYSTEM_BETA)
        assert "cannot render BOOM" in e.value.message
        assert "Unexpected role" not in e.value.message
    finally:
        stop()


# ------------------------------------------------------------------ OpenAI Responses

def gpt(info):
    return openai.OpenAI(base_url=info["base_url"], api_key=info["api_key"], max_retries=0,
                         timeout=WAIT_S, http_client=http_client())


EXEC = {"type": "function", "name": "exec_command", "description": "Run a command.",
        "strict": False, "parameters": {"type": "object", "properties": {
            "cmd": {"type": "string"}}, "required": ["cmd"]}}
SPAWN = {"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent.",
         "strict": False, "parameters": {"type": "object", "properties": {
             "message": {"type": "string"}}, "required": ["message"]}}
# What Codex 0.171 sends with its default settings (observed from a run of the real CLI).
CODEX_TOOLS = [EXEC, {"type": "namespace", "name": "multi_agent_v1",
                      "description": "Tools for spawning and managing sub-agents.",
                      "tools": [SPAWN]},
               {"type": "web_search", "external_web_access": False}]
SPAWN_CALL = '<tool_call>\n{"name": "spawn_agent", "arguments": {"message": "look"}}\n</tool_call>'


def test_namespace_tools_are_offered_and_their_calls_carry_the_namespace(env):
    """Codex's multi-agent namespace: its functions are offered by name (the group's
    description first), a call comes back with `namespace`, and the call sent back
    continues the same episode. web_search is left out of the prompt, counted and named."""
    info = create(env, "namespace")
    client = gpt(info)
    env["sampler"].queue.extend([SPAWN_CALL, "done"])
    events = list(client.responses.create(model="tiny", input="Delegate it.", tools=CODEX_TOOLS,
                                          stream=True, store=False,
                                          reasoning={"summary": "auto"}))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    (call,) = [i for i in done if i.type == "function_call"]
    assert (call.name, call.namespace) == ("spawn_agent", "multi_agent_v1")
    assert json.loads(call.arguments) == {"message": "look"}
    prompt = env["tok"].decode(env["sampler"].prompts[-1])
    assert '"name": "spawn_agent"' in prompt and '"name": "exec_command"' in prompt
    assert json.dumps("Tools for spawning and managing sub-agents.\n\nSpawn a sub-agent.") in (
        prompt)
    assert "web_search" not in prompt
    again = client.responses.create(model="tiny", tools=CODEX_TOOLS, store=False, input=[
        {"role": "user", "content": "Delegate it."},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "namespace": call.namespace, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "agent-1"}])
    assert again.output_text == "done"
    trace = trace_of(env, info)
    (episode,) = trace["episodes"]  # the call sent back spliced onto the sampled turn
    assert len(episode["completions"]) == 2
    assert trace["metadata"]["omitted_tools"] == ["web_search"]
    status = env["admin"].get(f"/v1/rollouts/{info['rollout_id']}").json()
    assert status["builtin_tools_omitted"] == 2


def test_builtin_tools_refused_by_name_when_the_server_says_so(env):
    info = create(env, "refuse", url=env["refuse_url"])
    with pytest.raises(openai.BadRequestError) as e:
        gpt(info).responses.create(model="tiny", input="hi", tools=CODEX_TOOLS)
    assert e.value.body["param"] == "tools[2].type" and "'web_search'" in e.value.message
    assert "--builtin_tools=omit" in e.value.message


def test_a_required_call_with_only_builtin_tools_names_them(env):
    """Review: tools=[web_search] with tool_choice 'required' said "'tools' is empty"."""
    info = create(env, "only-builtin")
    with pytest.raises(openai.BadRequestError) as e:
        gpt(info).responses.create(model="tiny", input="hi", tool_choice="required",
                                   tools=[{"type": "web_search"}])
    assert "is empty" not in e.value.message and "web_search" in e.value.message


def test_a_function_offered_twice_across_namespaces_is_refused(env):
    info = create(env, "twice")
    tools = [SPAWN, {"type": "namespace", "name": "ns", "description": "d", "tools": [SPAWN]}]
    with pytest.raises(openai.BadRequestError) as e:
        gpt(info).responses.create(model="tiny", input="hi", tools=tools)
    assert e.value.body["param"] == "tools" and "spawn_agent" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # a member that is no function
        gpt(info).responses.create(model="tiny", input="hi", tools=[
            {"type": "namespace", "name": "ns", "description": "d",
             "tools": [{"type": "custom", "name": "x"}]}])
    assert e.value.body["param"] == "tools[0].tools[0].type"


# ------------------------------------------------------------------ Gemini API

def gemini(info, **headers):
    from google import genai
    from google.genai import types

    return genai.Client(api_key=info["api_key"], http_options=types.HttpOptions(
        base_url=info["gemini_base_url"], headers=headers or None,
        retry_options=types.HttpRetryOptions(attempts=1), **GENAI_SSL))


ADD_DECL = {"name": "add", "description": "Add two integers.", "parameters_json_schema": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}
ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def test_gemini_generate_content_holds_a_tool_round_trip_in_one_episode(env):
    """google-genai against /v1beta: systemInstruction, functionDeclarations, a
    functionCall answered and its functionResponse sent back: one episode, each prompt
    the chat template's rendering of the same conversation."""
    from google.genai import types

    info = create(env, "gemini")
    client = gemini(info)
    config = types.GenerateContentConfig(
        system_instruction="You add numbers.", temperature=0,
        tools=[types.Tool(function_declarations=[types.FunctionDeclaration(**ADD_DECL)])])
    env["sampler"].queue.extend([ADD_CALL, "It is 5."])
    first = client.models.generate_content(model="tiny", contents="What is 2+3?", config=config)
    (call,) = first.function_calls
    assert (call.name, call.args) == ("add", {"a": 2, "b": 3})
    assert first.candidates[0].finish_reason == types.FinishReason.STOP
    assert first.usage_metadata.prompt_token_count == len(env["sampler"].prompts[-1])
    contents = [types.Content(role="user", parts=[types.Part(text="What is 2+3?")]),
                first.candidates[0].content,
                types.Content(role="user", parts=[types.Part(function_response=
                    types.FunctionResponse(name="add", id=call.id, response={"result": 5}))])]
    second = client.models.generate_content(model="tiny", contents=contents, config=config)
    assert second.text == "It is 5."
    (episode,) = trace_of(env, info)["episodes"]
    first_c, second_c = episode["completions"]
    assert first_c["request_id"] == first.response_id
    tools = [{"type": "function", "function": {
        "name": "add", "description": ADD_DECL["description"],
        "parameters": ADD_DECL["parameters_json_schema"]}}]
    chat = [{"role": "system", "content": "You add numbers."},
            {"role": "user", "content": "What is 2+3?"}]
    assert first_c["prompt_ids"] == build_prompt_ids(env["tok"], chat, tools, TurnMemory())[0]
    # The second prompt extends the first prompt + its sampled output, token for token.
    assert second_c["prompt_ids"][:len(first_c["prompt_ids"]) + len(first_c["output_ids"])] == (
        first_c["prompt_ids"] + first_c["output_ids"])
    assert '{"result": 5}' in env["tok"].decode(second_c["prompt_ids"])


def test_gemini_stream_count_tokens_and_models(env):
    from google.genai import types

    info = create(env, "gemini-stream")
    client = gemini(info, **{"X-Agent": "side"})
    env["sampler"].queue.append("hello there friend")
    chunks = list(client.models.generate_content_stream(
        model="tiny", contents="Greet me.", config=types.GenerateContentConfig(
            thinking_config=types.ThinkingConfig(include_thoughts=True), top_k=64)))
    assert "".join(c.text or "" for c in chunks) == "hello there friend"
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP
    prompt_len = len(env["sampler"].prompts[-1])
    assert chunks[-1].usage_metadata.prompt_token_count == prompt_len
    assert client.models.count_tokens(model="tiny", contents="Greet me.").total_tokens == (
        prompt_len)
    (episode,) = trace_of(env, info)["episodes"]
    assert episode["agent"] == "side"
    assert [m.name for m in client.models.list()] == ["models/tiny"]
    assert client.models.get(model="tiny").input_token_limit == env["sampler"].max_context


def test_gemini_generation_config_reaches_the_sampler(env):
    """Review: every honoured generationConfig field is what the sampler is asked
    with (temperature, topP, topK, maxOutputTokens, seed, stopSequences), a cut
    answer is finishReason MAX_TOKENS, a stop sequence ends the text with STOP."""
    from google.genai import types

    info = create(env, "gemini-config")
    client = gemini(info)
    config = types.GenerateContentConfig(temperature=0.5, top_p=0.9, top_k=40,
                                         max_output_tokens=7, seed=11, stop_sequences=["END"])
    client.models.generate_content(model="tiny", contents="n?", config=config)
    p = env["sampler"].params[-1]
    assert (p.temperature, p.top_p, p.top_k, p.seed) == (0.5, pytest.approx(0.9), 40, 11)
    assert p.max_tokens == 7 and "END" in p.stop
    env["sampler"].queue.append("one two three four five six")
    cut = client.models.generate_content(model="tiny", contents="count", config=types.
                                         GenerateContentConfig(max_output_tokens=2))
    assert cut.candidates[0].finish_reason == types.FinishReason.MAX_TOKENS
    assert cut.usage_metadata.candidates_token_count == 2
    env["sampler"].queue.append("alpha END beta")
    stopped = client.models.generate_content(model="tiny", contents="go", config=types.
                                             GenerateContentConfig(stop_sequences=["END"]))
    assert stopped.text == "alpha " and (
        stopped.candidates[0].finish_reason == types.FinishReason.STOP)


def test_gemini_json_output_without_grammars_names_the_gemini_fields(env):
    """Review: the refusal named the chat core's 'response_format', which a Gemini
    client never sends."""
    from google.genai import errors, types

    info = create(env, "gemini-json")
    client = gemini(info)
    with pytest.raises(errors.ClientError) as e:
        client.models.generate_content(model="tiny", contents="n?", config=types.
                                       GenerateContentConfig(response_mime_type="application/json"))
    assert e.value.status == "INVALID_ARGUMENT" and "response_format" not in e.value.message
    assert "generationConfig.responseMimeType" in e.value.message


def test_gemini_count_tokens_of_a_history_that_ends_with_the_model(env):
    """Review: countTokens of a conversation whose last content is the model's (a
    history, as Gemini CLI counts it) is a Gemini request; it was refused as prefill."""
    info = create(env, "gemini-count")
    history = [{"role": "user", "parts": [{"text": "hi"}]},
               {"role": "model", "parts": [{"text": "hello"}]}]
    r = http_post(env["url"] + f"/v1beta/models/tiny:countTokens?key={info['api_key']}",
                   json={"contents": history}, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    shorter = http_post(env["url"] + f"/v1beta/models/tiny:countTokens?key={info['api_key']}",
                         json={"contents": history[:1]}, timeout=WAIT_S)
    assert r.json()["totalTokens"] > shorter.json()["totalTokens"]
    whole = http_post(env["url"] + f"/v1beta/models/tiny:countTokens?key={info['api_key']}",
                       json={"generateContentRequest": {"model": "models/tiny",
                                                        "contents": history}}, timeout=WAIT_S)
    assert whole.json() == r.json()


def test_gemini_function_response_naming_another_function_than_its_call(env):
    """Review: a functionResponse whose id is a call's but whose name is another
    function's answered that call silently."""
    info = create(env, "gemini-mismatch")
    contents = [{"role": "user", "parts": [{"text": "add"}]},
                {"role": "model", "parts": [{"functionCall": {"name": "add", "args": {},
                                                               "id": "c1"}}]},
                {"role": "user", "parts": [{"functionResponse": {
                    "name": "sub", "id": "c1", "response": {"r": 1}}}]}]
    r = http_post(env["url"] + f"/v1beta/models/tiny:generateContent?key={info['api_key']}",
                   json={"contents": contents}, timeout=WAIT_S)
    assert r.status_code == 400 and r.json()["error"]["status"] == "INVALID_ARGUMENT"
    assert "'sub'" in r.json()["error"]["message"] and "'add'" in r.json()["error"]["message"]


def test_gemini_stream_of_a_function_call(env):
    """Gemini CLI always streams: a sampled call comes back as a functionCall part,
    never as its tool-call markup in text chunks."""
    from google.genai import types

    info = create(env, "gemini-stream-call")
    client = gemini(info)
    config = types.GenerateContentConfig(
        tools=[types.Tool(function_declarations=[types.FunctionDeclaration(**ADD_DECL)])])
    env["sampler"].queue.append(ADD_CALL)
    chunks = list(client.models.generate_content_stream(model="tiny", contents="2+3?",
                                                        config=config))
    assert not any("tool_call" in (c.text or "") for c in chunks)
    calls = [fc for c in chunks for fc in c.function_calls or ()]
    assert [(fc.name, fc.args) for fc in calls] == [("add", {"a": 2, "b": 3})]
    assert chunks[-1].candidates[0].finish_reason == types.FinishReason.STOP


def test_get_v1_models_serves_the_openai_and_the_gemini_client(env):
    """Review: GET /v1/models/{model} answered only the Gemini entry (for google-genai's
    api_version v1), so the openai client's models.retrieve had no id."""
    from google import genai
    from google.genai import types

    info = create(env, "models-get")
    model = gpt(info).models.retrieve("tiny")
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "ac2_jax")
    v1 = genai.Client(api_key=info["api_key"], http_options=types.HttpOptions(
        base_url=info["gemini_base_url"], api_version="v1",
        retry_options=types.HttpRetryOptions(attempts=1), **GENAI_SSL))
    got = v1.models.get(model="tiny")
    assert got.name == "models/tiny" and got.input_token_limit == env["sampler"].max_context


@pytest.mark.parametrize("config,named", [
    ({"tools": [{"google_search": {}}]}, "googleSearch"),
    ({"tools": [{"code_execution": {}}]}, "codeExecution"),
    ({"candidate_count": 2}, "candidateCount"),
])
def test_gemini_refuses_by_name_what_it_cannot_serve(env, config, named):
    from google.genai import errors

    info = create(env, "gemini-refuse")
    client = gemini(info)  # held: a google-genai Client closes its connection when collected
    with pytest.raises(errors.ClientError) as e:
        client.models.generate_content(model="tiny", contents="hi", config=config)
    assert e.value.code == 400 and e.value.status == "INVALID_ARGUMENT"
    assert named in e.value.message


def test_gemini_safety_settings_only_without_filtering(env):
    """Review: safetySettings were accepted and ignored. This server has no safety
    filter: a threshold that means "no filtering" is accepted, any other is a 400
    INVALID_ARGUMENT naming the field and the threshold."""
    from google.genai import errors, types

    info = create(env, "gemini-safety")
    client = gemini(info)
    cat = types.HarmCategory.HARM_CATEGORY_HARASSMENT
    for ok in ("BLOCK_NONE", "OFF", "HARM_BLOCK_THRESHOLD_UNSPECIFIED"):
        got = client.models.generate_content(model="tiny", contents="hi", config={
            "max_output_tokens": 2, "safety_settings": [{"category": cat, "threshold": ok}]})
        assert got.candidates[0].content.role == "model"
    with pytest.raises(errors.ClientError) as e:
        client.models.generate_content(model="tiny", contents="hi", config={
            "safety_settings": [{"category": cat, "threshold": "BLOCK_NONE"},
                                {"category": cat, "threshold": "BLOCK_LOW_AND_ABOVE"}]})
    assert e.value.code == 400 and e.value.status == "INVALID_ARGUMENT"
    assert "safetySettings[1].threshold" in e.value.message
    assert "BLOCK_LOW_AND_ABOVE" in e.value.message and "BLOCK_NONE" in e.value.message


def test_gemini_schema_to_json_schema():
    """Review: only `type` was lower-cased. nullable -> a type union with null (and
    null in an enum), propertyOrdering dropped (ordering, no constraint),
    TYPE_UNSPECIFIED refused by name; a property named like a keyword is a property."""
    from ac2_jax.serving.apis.gemini.schemas import json_schema

    got = json_schema({
        "type": "OBJECT", "propertyOrdering": ["nullable", "b"],
        "properties": {"nullable": {"type": "STRING", "nullable": True, "enum": ["x"],
                                    "format": "enum"},
                       "b": {"type": "ARRAY", "items": {"type": "INTEGER", "nullable": False}},
                       "c": {"anyOf": [{"type": "NUMBER"}], "nullable": True}}})
    assert got == {
        "type": "object",
        "properties": {"nullable": {"type": ["string", "null"], "enum": ["x", None]},
                       "b": {"type": "array", "items": {"type": "integer"}},
                       "c": {"anyOf": [{"type": "number"}, {"type": "null"}]}}}
    with pytest.raises(ValueError, match=r"properties\.a\.type: TYPE_UNSPECIFIED"):
        json_schema({"type": "OBJECT", "properties": {"a": {"type": "TYPE_UNSPECIFIED"}}})


def test_gemini_type_unspecified_is_refused_in_its_error_shape(env):
    from google.genai import errors

    info = create(env, "gemini-schema")
    client = gemini(info)
    decl = {"name": "f", "parameters": {"type": "OBJECT", "properties": {
        "a": {"type": "TYPE_UNSPECIFIED"}}}}
    with pytest.raises(errors.ClientError) as e:
        client.models.generate_content(model="tiny", contents="hi",
                                       config={"tools": [{"function_declarations": [decl]}]})
    assert e.value.code == 400 and e.value.status == "INVALID_ARGUMENT"
    assert "TYPE_UNSPECIFIED" in e.value.message and "properties.a.type" in e.value.message


def test_gemini_refuses_inline_images_and_answers_in_its_error_shape(env):
    from google.genai import errors, types

    info = create(env, "gemini-errors")
    image = types.Part.from_bytes(data=b"\x89PNG....", mime_type="image/png")
    client = gemini(info)
    with pytest.raises(errors.ClientError) as e:
        client.models.generate_content(model="tiny", contents=["look", image])
    assert "inlineData" in e.value.message and "text-only" in e.value.message
    r = http_post(env["url"] + "/v1beta/models/tiny:generateContent?key=sk-wrong",
                   json={"contents": [{"parts": [{"text": "hi"}]}]})
    assert r.status_code == 401 and r.json()["error"]["status"] == "UNAUTHENTICATED"
    r = http_post(env["url"] + f"/v1beta/models/tiny:streamGenerateContent?key={info['api_key']}",
                   json={"contents": [{"parts": [{"text": "hi"}]}]})
    assert r.status_code == 400 and "alt=sse" in r.json()["error"]["message"]
    r = http_post(env["url"] + f"/v1beta/models/tiny:generateContent?key={info['api_key']}",
                   json={"model": "models/other", "contents": [{"parts": [{"text": "hi"}]}]})
    assert r.status_code == 400 and "'models/other'" in r.json()["error"]["message"]
    r = http_post(env["url"] + f"/v1beta/models/nope:generateContent?key={info['api_key']}",
                   json={"contents": [{"parts": [{"text": "hi"}]}]})
    assert r.status_code == 404 and r.json()["error"]["status"] == "NOT_FOUND"


# ------------------------------------------------------------------ agents in one rollout

TITLE_SYSTEM = "You are a title generator. You output ONLY a thread title."
MEMORY_SYSTEM = "Extract durable memories from the conversation."


def test_agent_rules_label_side_conversations_by_their_system_prompt(env):
    """opencode's title generator and Qwen Code's memory extractor send no X-Agent:
    the rollout's agent_rules label them by a regex over, or the fingerprint of, their
    system prompt, so `train_agents` can include or leave them out."""
    from ac2_jax.serving.lifecycle.rollout_requests import system_fingerprint
    from ac2_jax.trace import Trace
    from ac2_jax.trace.agents import agent_matches

    rules = [{"agent": "title", "system_regex": r"^You are a title generator"},
             {"agent": "memory", "system_sha256": system_fingerprint(MEMORY_SYSTEM)[:12]}]
    info = create(env, "rules", agent_rules=rules)
    client = gpt(info)

    def ask(system, **kw):
        client.chat.completions.create(model="tiny", max_tokens=4, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "hi"}], **kw)

    ask("You are a coding agent.")
    ask(TITLE_SYSTEM)
    ask(MEMORY_SYSTEM)
    ask(TITLE_SYSTEM, extra_headers={"X-Agent": "named"})  # a named agent wins
    # The same rule over the Anthropic API (top-level system) and the Gemini API.
    claude(info).messages.create(model="tiny", system=TITLE_SYSTEM, max_tokens=4,
                                 messages=[{"role": "user", "content": "again"}])
    g = gemini(info)  # held: a google-genai Client closes its connection when collected
    g.models.generate_content(model="tiny", contents="once more", config={
        "system_instruction": MEMORY_SYSTEM, "max_output_tokens": 4})
    trace = trace_of(env, info)
    assert sorted(e["agent"] for e in trace["episodes"]) == [
        "main", "memory", "memory", "named", "title", "title"]
    assert trace["metadata"]["agent_rules"] == rules
    kept = [e.agent for e in Trace.from_dict(trace).episodes
            if agent_matches(e.agent, ("main",))]  # train_agents=("main",)
    assert kept == ["main"]
    r = env["admin"].post("/v1/rollouts", json={"task_id": "x", "agent_rules": [
        {"agent": "a", "system_regex": "("}]})
    assert r.status_code == 400 and "agent_rules[0]" in r.json()["error"]["param"]
    assert "does not compile" in r.json()["error"]["message"]


# ------------------------------------------------------------------ serving defaults

def test_tiny_is_served_with_a_context_that_fits_the_clis_prompts(tmp_path):
    """The README's `python -m ac2_jax.serving --model=tiny` had 2,048 tokens; Claude
    Code's default request is about 45k tokens of the tiny tokenizer."""
    from ac2_jax.serving.server import TINY_CONTEXT, load_policy

    sampler, tok, _ = load_policy("tiny", tokenizer_dir=str(tmp_path / "tok"))
    try:
        assert sampler.max_context == TINY_CONTEXT >= 48_000
    finally:
        sampler.close()


def test_a_prompt_past_the_context_is_a_400_naming_the_flag(env):
    info = create(env, "too-long")
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(info).messages.create(model="tiny", max_tokens=4, messages=[
            {"role": "user", "content": "hello " * 5000}])
    assert "maximum context length is 4096" in e.value.message
    assert "--max_context=" in e.value.message
