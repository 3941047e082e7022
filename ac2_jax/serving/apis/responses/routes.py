"""POST /v1/responses (the OpenAI Responses API) and GET /v1/responses/{id}.

A Responses request is turned into the Chat Completions request a chat
client would send for the same conversation and served by the shared core
(`generation.serve_request`): the same chat template, the same splice of
the rollout's sampled ids, the same recording. So a conversation held through
/v1/responses (full input each turn, or chained by previous_response_id) is
one append-only episode, and a rollout may switch between this route and
/v1/chat/completions freely. The recorded `Completion.request_id` is the
`resp_...` id the client sees.

Items to chat messages: a message item is a message (developer -> system;
text parts joined by newlines, as chat text parts are); a function_call opens
an assistant turn with `tool_calls` [{id: call_id, type: function, function:
{name, arguments}}], or joins the one an assistant message or an earlier call
opened (consecutive calls are one turn, with the text of that turn); a
function_call_output is {role: tool, tool_call_id, content} and must answer a
function_call earlier in the conversation (400 at `input[i].call_id`). The
response and its events are `responses_output`'s.

Fields. Honoured:
  model                 the served model (404 otherwise)
  input                 a string (one user message) or items, see above
  instructions          a system message before the items; not carried over by
                        previous_response_id (as OpenAI)
  tools                 function tools, rendered as a chat client sends them:
                        {type: function, function: {name, description, parameters}};
                        strict true only where the calls are decoded under their
                        schema (see tool_choice; else 400). A namespace tool
                        {type: namespace, name, description, tools: [functions]}
                        (Codex's multi-agent group): its functions are offered under
                        their own names (unique across the request, else 400), each
                        description opened by the group's; a call of one comes back
                        as a function_call item with `namespace` set to the group
                        (as OpenAI answers), and an input function_call's `namespace`
                        is read back so. Built-in tools (web_search, file_search,
                        code_interpreter, ...: `BUILTIN_TOOLS`) are run by OpenAI, never
                        here: the server option `builtin_tools` (build_app, the
                        --builtin_tools flag) leaves them out of the model's prompt
                        ("omit", the default, so Codex's default request, which offers
                        web_search, runs; counted per tool in the rollout's
                        `builtin_tools_omitted` and named in its trace metadata's
                        `omitted_tools`) or refuses the request ("refuse": 400 at
                        `tools[i].type`)
  tool_choice, parallel_tool_calls, text.format
                        as Chat Completions' tool_choice, parallel_tool_calls and
                        response_format (`structured`): auto | none (tools rendered,
                        no call parsed) | required | {type: function, name} (whole
                        calls under a grammar); false holds such a turn to one call;
                        {"type": "json_object"} / {"type": "json_schema", name,
                        schema, strict, description} constrain the answer
  max_output_tokens, temperature, top_p, stream, seed (extension), agent
                        (extension; the X-Agent header wins)
  previous_response_id  continues a stored response of the same key: its input
                        and output items come first. Unknown, another rollout's,
                        store=false or dropped: 400 previous_response_not_found
  store                 default true: kept in memory (`ResponseStore`: the last
                        MAX_STORED per rollout and for the admin key, dropped once
                        the rollout ends) for previous_response_id and GET
  include ["message.output_text.logprobs"], top_logprobs
                        logprobs of every sampled token (stop and tool-call tokens
                        too, as Chat Completions) on the output_text part; a
                        response of function calls only has no part to carry them
Accepted, no effect (and why):
  metadata, client_metadata (Codex sends it), user, safety_identifier
                        tags and end-user ids; never the agent label
  prompt_cache_key      prefix caching is automatic
  service_tier          "auto" / "default" (one tier); truncation "disabled" (the
                        only behaviour: an over-long prompt is a 400)
  reasoning             effort null or "none", any summary: these models do not
                        reason, so there is nothing to summarise; include
                        "reasoning.encrypted_content": no reasoning items exist
  text.verbosity        "medium" (the neutral value)
  stream_options        include_obfuscation false
  items' id, status, phase; output_text annotations, logprobs
                        echoes of earlier outputs: the template renders text only
Refused (400 naming the field): reasoning effort other than "none" (Codex sends
reasoning null for a model it does not know as a reasoning one); verbosity
low / high; custom tools (and built-in ones under builtin_tools "refuse"),
tool_choice of those or allowed_tools;
reasoning, item_reference and built-in-tool items; input_image / input_file /
refusal parts; other include values; truncation "auto"; service tiers flex /
scale / priority; background, conversation, max_tool_calls, prompt,
prompt_cache_retention, context_management unless null; any other field.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request

from ac2_jax.serving.apis.responses._output import Answer, ResponsesWriter
from ac2_jax.serving.apis.responses.schemas import (
    TOOL_TAGS,
    BuiltinTool,
    FunctionTool,
    InputItem,
    NamespaceTool,
    ResponsesBody,
)
from ac2_jax.serving.core import requests as req_lib
from ac2_jax.serving.core.errors import APIError, bad_request
from ac2_jax.serving.core.generation import (
    agent_label,
    chat_prompt_ids,
    check_model,
    serve_request,
    start_request,
)
from ac2_jax.serving.core.sample_run import ServeContext
from ac2_jax.serving.core.schemas import UNSUPPORTED, validate
from ac2_jax.serving.core.structured import (
    forces_call,
    grammar_forces_calls,
    response_schema,
    sampler_grammars,
)
from ac2_jax.serving.lifecycle.rollouts import Rollout

__all__ = [
    "BUILTIN_TOOL_POLICIES",
    "MAX_STORED",
    "ResponseStore",
    "chat_messages",
    "install_responses_routes",
]

MAX_STORED = 256  # stored responses per rollout (and for the admin key); oldest dropped first
# What the server does with a built-in tool (web_search, ...) it cannot run: leave it out
# of the model's prompt (recorded: the rollout's `builtin_tools_omitted` counter and the
# trace metadata's `omitted_tools`), or refuse the request (400 naming it).
BUILTIN_TOOL_POLICIES = ("omit", "refuse")


# ------------------------------------------------------------------------------ the store


@dataclass(frozen=True)
class StoredResponse:
    items: list[dict]  # the conversation: every input item of the chain, then the output
    body: dict  # the response as answered


class ResponseStore:
    """Stored responses by (rollout, id); the admin key's under rollout None.
    Thread-safe; at most `per_owner` each (oldest dropped first), and a
    rollout's are dropped once it no longer runs."""

    def __init__(self, per_owner: int = MAX_STORED):
        self.per_owner = per_owner
        self._lock = threading.Lock()
        self._by_owner: dict[str | None, collections.OrderedDict[str, StoredResponse]] = {}
        self._rollouts: dict[str, Rollout] = {}

    def put(self, rollout: Rollout | None, response_id: str, stored: StoredResponse) -> None:
        owner = None if rollout is None else rollout.rollout_id
        with self._lock:
            for rid, r in list(self._rollouts.items()):
                if not r.running:
                    del self._rollouts[rid]
                    self._by_owner.pop(rid, None)
            if rollout is not None:
                if not rollout.running:
                    return
                self._rollouts[rollout.rollout_id] = rollout
            entries = self._by_owner.setdefault(owner, collections.OrderedDict())
            entries[response_id] = stored
            while len(entries) > self.per_owner:
                entries.popitem(last=False)

    def get(self, rollout: Rollout | None, response_id: str) -> StoredResponse | None:
        owner = None if rollout is None else rollout.rollout_id
        with self._lock:
            entries = self._by_owner.get(owner)
            return None if entries is None else entries.get(response_id)


# ------------------------------------------------------------------------------ translation


def _text(parts: list | None) -> str:
    return "\n".join(p.text for p in parts or ())


def conversation_item(item: InputItem) -> dict[str, Any]:
    """A validated input item in the plain form the store keeps."""
    if item.kind == "function_call":
        out = {
            "type": "function_call",
            "call_id": item.call_id,
            "name": item.name,
            "arguments": item.arguments,
        }
        if item.namespace is not None:
            out["namespace"] = item.namespace
        return out
    if item.kind == "function_call_output":
        return {
            "type": "function_call_output",
            "call_id": item.call_id,
            "output": _text(item.output),
        }
    return {"type": "message", "role": item.role, "content": _text(item.content)}


def check_call_ids(prior: list[dict], new: list[dict]) -> None:
    """Each function_call_output answers a function_call before it (400 at its call_id)."""
    calls = {it["call_id"] for it in prior if it["type"] == "function_call"}
    for i, it in enumerate(new):
        if it["type"] == "function_call":
            calls.add(it["call_id"])
        elif it["type"] == "function_call_output" and it["call_id"] not in calls:
            raise bad_request(
                f"No function_call with call_id {it['call_id']!r} comes before this output "
                "(in input or the previous_response_id chain); send the call item too",
                param=f"input[{i}].call_id",
            )


def chat_messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """The OpenAI chat messages of a conversation, as a chat client sends them."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "system", "content": instructions})
    turn: dict[str, Any] | None = None  # the assistant turn function calls join
    for it in items:
        if it["type"] == "function_call":
            if turn is None:
                turn = {"role": "assistant", "content": None}
                messages.append(turn)
            call = {"name": it["name"], "arguments": it["arguments"]}
            turn.setdefault("tool_calls", []).append(
                {"id": it["call_id"], "type": "function", "function": call}
            )
        elif it["type"] == "function_call_output":
            turn = None
            messages.append(
                {"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]}
            )
        else:
            messages.append({"role": it["role"], "content": it["content"]})
            turn = messages[-1] if it["role"] == "assistant" else None
    return messages


def response_format(body: ResponsesBody) -> dict | None:
    """text.format as Chat Completions' response_format (None: text)."""
    fmt = body.text.format if body.text else None
    if fmt is None or fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def check_strict(
    tokenizer: Any, body: ResponsesBody, req: req_lib.ChatRequest, grammars: bool = True
) -> None:
    """A strict tool needs its calls decoded under a grammar (`structured`; grammars:
    the sampler decodes them, `structured.sampler_grammars`)."""
    strict = [i for i, t in enumerate(body.tools or ()) if isinstance(t, FunctionTool) and t.strict]
    strict += [
        i
        for i, t in enumerate(body.tools or ())
        if isinstance(t, NamespaceTool) and any(f.strict for f in t.tools)
    ]
    constrained = forces_call(req) or (
        response_schema(req.response_format) is not None and req.parse_tools
    )
    if strict and not (constrained and grammars and grammar_forces_calls(tokenizer)):
        raise bad_request(
            f"'tools[{strict[0]}].strict' true is honoured only where the calls are decoded "
            "under their schema: tool_choice 'required' or a named function, or a JSON "
            "text.format, with a model whose tool-call format has a grammar (Hermes) "
            "and a sampler that decodes grammars (the JaxSampler); "
            "send strict false or null",
            param=f"tools[{strict[0]}].strict",
            code=UNSUPPORTED,
        )


def chat_tools(tools: list | None) -> list[dict] | None:
    """The function tools the model is offered, as a chat client sends them: the
    top-level functions and each namespace's, in order; built-in tools are not among
    them (`builtin_tools`)."""
    out: list[dict] = []
    for tool in tools or ():
        if isinstance(tool, FunctionTool):
            out.append(tool.as_chat_tool())
        elif isinstance(tool, NamespaceTool):
            out += tool.as_chat_tools()
    return out or None


def builtin_tools(body: ResponsesBody, policy: str) -> list[str]:
    """The types of the request's built-in tools, which the model is not offered
    (policy "omit"); policy "refuse": the 400 naming the first."""
    found = [(i, t.type) for i, t in enumerate(body.tools or ()) if isinstance(t, BuiltinTool)]
    if found and policy == "refuse":
        i, kind = found[0]
        raise bad_request(
            f"'tools[{i}].type' {kind!r} is a built-in tool, which this server does not run "
            "(it serves function tools only); remove it, or start the server with "
            "--builtin_tools=omit to leave built-in tools out of the model's prompt",
            param=f"tools[{i}].type",
            code=UNSUPPORTED,
        )
    return [kind for _, kind in found]


def chat_request(body: ResponsesBody, messages: list[dict]) -> req_lib.ChatRequest:
    choice = body.tool_choice
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return req_lib.ChatRequest(
        model=body.model,
        max_tokens=body.max_output_tokens,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        seed=body.seed,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        stream=bool(body.stream),
        agent=body.agent,
        messages=messages,
        tools=chat_tools(body.tools),
        tool_choice=choice,
        forced_tool=body.forced_tool,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=response_format(body),
    )


# ------------------------------------------------------------------------------ routes


def _as_input(e: APIError) -> APIError:
    """An error the chat core names `messages` is about this request's `input`."""
    if e.param == "messages":
        e.param = "input"
    return e


def install_responses_routes(
    app: FastAPI,
    ctx: ServeContext,
    *,
    authenticate: Callable,
    read_json: Callable,
    builtin_tool_policy: str = "omit",
) -> ResponseStore:
    """Adds POST /v1/responses and GET /v1/responses/{id} to `app`; returns their store.
    builtin_tool_policy: `BUILTIN_TOOL_POLICIES` (see the module docstring)."""
    if builtin_tool_policy not in BUILTIN_TOOL_POLICIES:
        raise ValueError(
            f"builtin_tool_policy must be one of {BUILTIN_TOOL_POLICIES}, "
            f"got {builtin_tool_policy!r}"
        )
    store = ResponseStore()

    @app.post("/v1/responses")
    async def create_response(request: Request):
        principal = await authenticate(request)
        body = validate(ResponsesBody, await read_json(request), TOOL_TAGS)
        check_model(ctx, body.model)
        omitted = builtin_tools(body, builtin_tool_policy)
        prior: list[dict] = []
        if body.previous_response_id is not None:
            stored = store.get(principal.rollout, body.previous_response_id)
            if stored is None:
                raise bad_request(
                    f"Previous response with id {body.previous_response_id!r} not found: "
                    "unknown, made with another key, made with store=false, or dropped "
                    f"(the last {MAX_STORED} are kept while the rollout runs)",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            prior = stored.items
        new = [conversation_item(it) for it in body.input or ()]
        check_call_ids(prior, new)
        if not prior and not new:
            raise bad_request("'input' is required (or a previous_response_id)", param="input")
        items = prior + new
        messages = req_lib.normalize_messages(chat_messages(body.instructions, items))
        req = chat_request(body, messages)
        check_strict(ctx.tokenizer, body, req, sampler_grammars(ctx.sampler))
        agent = agent_label(request, req)
        try:
            prompt_ids = await chat_prompt_ids(ctx, principal, req)
            st = await start_request(
                ctx, request, principal, req, agent, prompt_ids, messages, True
            )
        except APIError as e:
            raise _as_input(e) from None

        def keep(rollout: Rollout | None, answered: dict, said: list[dict]) -> None:
            store.put(rollout, answered["id"], StoredResponse(items + said, answered))

        if omitted and principal.rollout is not None:  # never silent: counted and named
            ctx.registry.note_omitted_tools(principal.rollout, omitted)
        answer = Answer(ctx, body, keep)
        st.response_id = answer.id  # what the client sees is what is recorded
        writer = ResponsesWriter(ctx, st, answer) if req.stream else None
        return await serve_request(ctx, st, answer.finish, writer)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        principal = await authenticate(request)
        stored = store.get(principal.rollout, response_id)
        if stored is None:
            raise APIError(
                404,
                f"No stored response with id {response_id!r} for this key (store=false, "
                "another key's, or dropped)",
                param="response_id",
                code="response_not_found",
            )
        return stored.body

    return store
