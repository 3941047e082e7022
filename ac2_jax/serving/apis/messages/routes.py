"""The Anthropic Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A request is validated (`messages_schemas`, 400 naming the field, in
Anthropic's error shape), translated into the OpenAI chat messages and tools
a Chat Completions client would send for the same conversation, and served
by the one path of every request API (`chat_prompt_ids`, `start_request`,
`serve_request`): the same chat template, the same splicing of the rollout's
sampled ids, the same token-level recording. A conversation held through
this API is one episode, and so is one that switches between it and
/v1/chat/completions mid-rollout. The recorded `Completion.request_id` is
the `msg_...` id the client sees.

Request fields (null is taken as absent):
  model            honoured: 404 unless it is the served model.
  max_tokens       honoured; required, >= 1 (0, Anthropic's cache pre-warming, is refused).
  system           honoured: a string or text blocks (joined with "\\n"), the system message.
  messages         honoured: role user | assistant | system; content a string or blocks.
                   A system message inside `messages` (Anthropic's beta
                   mid-conversation-system-2026-04-07, which Claude Code 2.1 sends by default)
                   is a system turn at its place: the chat message {role: system} there,
                   rendered as the model's chat template renders a system message after
                   the first (Qwen/ChatML: its own <|im_start|>system turn), and recorded
                   so in the trace (the completion's `messages`). A template that cannot
                   render one there gets Anthropic's own 400 ('Unexpected role "system"
                   ... not "system" as an input message role'), on which Claude Code falls
                   back to sending it as <system-reminder> user text; any other role gets
                   a 400 in the same words ("Unexpected role ... input message role").
                   User and assistant content:
                   text; tool_use {id, name, input, caller: direct} (assistant) -> its
                   tool call (SDK dumps echo caller / toolset_name / citations as null);
                   tool_result {tool_use_id, content: string | text blocks, is_error}
                   (user) -> a tool message, before the user's text of that message;
                   is_error true starts the tool message with "Error: ".
                   Refused: image and document blocks (text-only model, named at their
                   `source`), thinking and other block types, text `citations` other
                   than null, and a last message from the assistant (prefill).
  tools            honoured: client tools {name, description, input_schema, type: "custom"}
                   rendered as OpenAI functions; server tools (web_search_..., bash_...,
                   ...) are refused by their `type`, tool fields Anthropic added later
                   (strict, input_examples, defer_loading, ...) as unknown.
  tool_choice      honoured as Chat Completions' tool_choice: auto -> "auto", none ->
                   "none" (tools rendered, calls stay text), any -> "required",
                   {type: tool, name} -> that function, forced alike (`structured`).
                   disable_parallel_tool_use: true -> parallel_tool_calls false: a forced
                   (constrained) call turn holds one call; unconstrained, every call the
                   model writes is returned.
  stop_sequences   honoured: stop_reason "stop_sequence" and the one that matched.
  temperature      honoured, Anthropic's range [0, 1] (0 is greedy); top_p (0, 1] and
  top_p, top_k     top_k >= 0 (0 = off) honoured.
  stream           honoured: Anthropic's named SSE events (`MessageEventWriter`).
  thinking         {"type": "disabled"} and {"type": "adaptive"} accepted (adaptive lets the
                   model decide whether to think; this policy never does: no thinking
                   blocks); "enabled" (a thinking budget) is refused: no thinking mode here.
  context_management  {edits: [{type: clear_thinking_<date>, keep}]} accepted, a no-op
                   (a conversation here has no thinking blocks to clear); other edits
                   (clear_tool_uses_..., which rewrite the conversation) are refused.
  output_config    format {type: json_schema, schema} honoured: the answer is decoded
                   under the schema's grammar, as Chat Completions' response_format
                   (`structured`); effort (low | medium | high | max) accepted, not acted
                   on (one policy, no effort levels). Claude Code sends all three.
  metadata         {user_id}: accepted, not acted on (Anthropic's end-user id; never the
                   agent label).
  cache_control    on system/text/tool_use/tool_result blocks, tools and the body:
                   {type: ephemeral, ttl?} accepted as a no-op (the sampler's prefix cache
                   is automatic; usage reports what it reused as cache_read_input_tokens).
  service_tier     "auto" | "standard_only": accepted; this server has one tier, the
                   standard one, which satisfies both.
  agent, seed      extensions (send them with `extra_body`): the agent label (the X-Agent
                   header wins, then `agent`, else "main") and the sampling seed.
Any other field is a 400 naming it. Headers: `x-api-key` (or Bearer) authenticates,
X-Agent labels; anthropic-version and anthropic-beta are not read (nothing here depends
on them). count_tokens takes the fields that shape the prompt
(model, system, messages, tools, tool_choice, thinking, cache_control, context_management,
output_config), renders them as
/v1/messages would (forced tool-call opening included) and answers {"input_tokens": n}.

Responses: content is a text block (if the answer has text) then one tool_use
block per call (`toolu_` + the call's id; input: the arguments as a JSON
object, or {"arguments": <what the model wrote>} when they are not one, a
turn that then renders from text when sent back);
stop_reason is end_turn | max_tokens | stop_sequence | tool_use. usage splits
the prompt as Anthropic does: input_tokens + cache_read_input_tokens (reused
from the prefix cache) + cache_creation_input_tokens (always 0) is the whole
prompt, which count_tokens counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

from ac2_jax.serving.apis.messages._blocks import SYSTEM_ROLE_REFUSED, UNION_TAGS
from ac2_jax.serving.apis.messages._output import (
    MessageEventWriter,
    message_body,
    new_message_id,
)
from ac2_jax.serving.apis.messages.schemas import CreateBody, PromptBody
from ac2_jax.serving.core import chat as chat_lib
from ac2_jax.serving.core import requests as req_lib
from ac2_jax.serving.core import schemas
from ac2_jax.serving.core.errors import APIError, bad_request
from ac2_jax.serving.core.generation import (
    agent_label,
    chat_prompt_ids,
    check_model,
    forced_prefix_ids,
    serve_request,
    start_request,
)
from ac2_jax.serving.core.sample_run import RequestState, ServeContext
from ac2_jax.serving.core.splice import build_prompt_ids

__all__ = [
    "MessageEventWriter",
    "chat_request",
    "install_messages_routes",
    "message_body",
    "validate",
]

# ------------------------------------------------------------------------------ requests


def _untagged(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """An error location as the client wrote the field: union tags left out."""
    return tuple(
        part
        for i, part in enumerate(loc)
        if not (
            i >= 2
            and isinstance(loc[i - 1], int)
            and isinstance(loc[i - 2], str)
            and part in UNION_TAGS.get(str(loc[i - 2]), ())
        )
    )


B = TypeVar("B", bound=PromptBody)  # the body model of a route


def validate(model_cls: type[B], body: Any) -> B:
    """`model_cls` from a parsed JSON body, or the 400 naming the first bad field
    (`schemas.api_error`, union tags left out of its name)."""
    if not isinstance(body, dict):
        raise bad_request(f"Request body must be a JSON object, got {type(body).__name__}")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        errors = [
            InitErrorDetails(
                type=PydanticCustomError(err["type"], "{message}", {"message": err["msg"]}),
                loc=_untagged(err["loc"]),
                input=err["input"],
            )
            for err in e.errors()
        ]
        untagged = ValidationError.from_exception_data(e.title, errors)
        raise schemas.api_error(model_cls, untagged) from None


def _tool_choice(body: PromptBody) -> tuple[str | dict | None, str | None]:
    """(ChatRequest.tool_choice, forced_tool) of Anthropic's tool_choice."""
    choice = body.tool_choice
    if choice is None:
        return None, None
    if choice.type == "tool":
        name = choice.name
        return {"type": "function", "function": {"name": name}}, name
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], None


def response_format(body: PromptBody) -> dict | None:
    """output_config.format as Chat Completions' response_format (None: text)."""
    fmt = body.output_config.format if body.output_config else None
    if fmt is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}


def chat_request(body: PromptBody) -> req_lib.ChatRequest:
    """The ChatRequest a Chat Completions client would send for `body`."""
    try:
        messages = req_lib.normalize_messages(body.chat_messages())
    except APIError as e:  # the schema's rules should make this unreachable
        raise bad_request(f"The messages do not translate to chat messages: {e.message}") from None
    tool_choice, forced_tool = _tool_choice(body)
    one_call = body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use
    fields: dict[str, Any] = dict(
        model=body.model,
        messages=messages,
        tools=body.chat_tools(),
        tool_choice=tool_choice,
        forced_tool=forced_tool,
        parallel_tool_calls=False if one_call else None,
        response_format=response_format(body),
    )
    if isinstance(body, CreateBody):
        fields.update(
            max_tokens=body.max_tokens,
            temperature=1.0 if body.temperature is None else float(body.temperature),
            top_p=1.0 if body.top_p is None else float(body.top_p),
            top_k=-1 if body.top_k is None else body.top_k,
            stop=tuple(body.stop_sequences or ()),
            seed=body.seed,
            stream=bool(body.stream),
            agent=body.agent,
        )
    return req_lib.ChatRequest(**fields)


def _system_turns_as_user_text(messages: list[dict]) -> list[dict]:
    """`messages` with each system message after the first folded into the next user
    message as leading text (a last one: a user message of its own), as Claude Code's
    fallback sends them."""
    out: list[dict] = []
    carry: list[str] = []
    for i, m in enumerate(messages):
        if i > 0 and m.get("role") == "system":
            content = m.get("content")
            if isinstance(content, list):
                content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
            carry.append(str(content or ""))
            continue
        if carry and m.get("role") == "user":
            text, content = "\n\n".join(carry), m.get("content")
            if isinstance(content, list):
                content = [{"type": "text", "text": text}, *content]
            else:
                content = text + ("\n\n" + content if content else "")
            m, carry = {**m, "content": content}, []
        out.append(m)
    if carry:
        out.append({"role": "user", "content": "\n\n".join(carry)})
    return out


async def _renders_without_system_turns(ctx: ServeContext, req) -> bool:
    messages = _system_turns_as_user_text(req.messages)
    try:
        await asyncio.to_thread(build_prompt_ids, ctx.tokenizer, messages, req.tools, None)
    except Exception:  # noqa: BLE001 - any failure: the system turns are not the cause
        return False
    return True


async def prompt_ids_of(ctx: ServeContext, principal, body: PromptBody, req) -> list[int]:
    """`chat_prompt_ids`, with a template that cannot render a mid-conversation system
    turn answered in Anthropic's words (Claude Code's fallback keys on them): only when
    the same conversation renders with those turns as user text (the fallback's form);
    any other template error is answered as it is."""
    try:
        return await chat_prompt_ids(ctx, principal, req)
    except APIError as e:
        if e.status != 400 or e.code is not None or not body.has_system_turns:
            raise
        if not await _renders_without_system_turns(ctx, req):
            raise
        raise bad_request(
            f"messages: {SYSTEM_ROLE_REFUSED} (this model's chat template cannot render a "
            f"system message mid-conversation: {e.message})",
            param="messages",
        ) from None


# ------------------------------------------------------------------------------ routes


def install_messages_routes(
    app: FastAPI, ctx: ServeContext, *, authenticate: Callable, read_json: Callable
) -> None:
    """Adds POST /v1/messages and POST /v1/messages/count_tokens to `app`."""

    def render(st: RequestState, choices: list[chat_lib.Choice], _version: int) -> dict:
        (choice,) = choices
        return message_body(ctx, st, choice)

    @app.post("/v1/messages")
    async def create_message(request: Request):
        principal = await authenticate(request)
        body = validate(CreateBody, await read_json(request))
        check_model(ctx, body.model)
        req = chat_request(body)
        agent = agent_label(request, req)
        prompt_ids = await prompt_ids_of(ctx, principal, body, req)
        st = await start_request(
            ctx, request, principal, req, agent, prompt_ids, req.messages, chat=True
        )
        st.response_id = new_message_id()  # before anything is sent or recorded
        writer = MessageEventWriter(ctx, st) if req.stream else None
        return await serve_request(ctx, st, render, writer)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        principal = await authenticate(request)
        body = validate(PromptBody, await read_json(request))
        check_model(ctx, body.model)
        req = chat_request(body)
        prompt_ids = await prompt_ids_of(ctx, principal, body, req)
        _prefix, prefix_ids = await forced_prefix_ids(ctx, req)  # as start_request adds it
        return {"input_tokens": len(prompt_ids) + len(prefix_ids)}
