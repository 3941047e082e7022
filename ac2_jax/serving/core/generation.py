"""The sampling routes: POST /v1/chat/completions and POST /v1/completions.

Each request runs its `n` samples as tasks; a rollout's samples carry its id
as their `route_key` (a `FleetSampler` keeps one rollout on one backend).
Rendering, tokenization, tool-call parsing and recording run in worker
threads, never on the event loop. A client that goes away (streaming or not)
cancels its samples and records nothing trainable: the rollout counts it in
`aborted_completions`. A `SamplerError` is a 503 and ends the rollout as
`infra_error`. Streaming sends tokens as the sampler accepts them
(`streaming.TextStream`).

tool_choice "required" / {"function": {"name"}} and response_format
json_object / json_schema constrain the output to a grammar
(`structured.request_constraint`, carried by `SamplingParams.constraint` and
recorded on the trace). For a tokenizer whose tool-call format has no
grammar, tool_choice forces a call by writing the tool-call opening
(`forced_prefix`) at the start of the assistant turn: those tokens go to the
prompt (loss mask 0), the model writes the rest.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ac2_jax.sampling import SamplingParams
from ac2_jax.serving.core import chat as chat_lib
from ac2_jax.serving.core import requests as req_lib
from ac2_jax.serving.core.errors import APIError, bad_request
from ac2_jax.serving.core.sample_run import (
    Generation,
    RequestState,
    ServeContext,
    finish_choices,
    record,
    run_generation,
    sse,
)
from ac2_jax.serving.core.splice import build_prompt_ids
from ac2_jax.serving.core.stream_generation import EventWriter, stream_events
from ac2_jax.serving.core.streaming import TOOL_CALL_OPEN, TokenFeed, WatchedStreamingResponse
from ac2_jax.serving.core.structured import (
    grammar_forces_calls,
    request_constraint,
    sampler_grammars,
)
from ac2_jax.text import Tokenizer

__all__ = [
    "AGENT_HEADER",
    "Generation",
    "build_prompt_ids",
    "chat_prompt_ids",
    "forced_prefix",
    "forced_prefix_ids",
    "install_generation_routes",
    "serve_request",
    "sse",
]

# How a request API answers a finished, recorded request: (state, choices,
# policy_version) -> the JSON body.
Render = Callable[[RequestState, list[chat_lib.Choice], int], dict]

AGENT_HEADER = "x-agent"


def forced_prefix(tokenizer: Tokenizer, req: req_lib.ChatRequest, grammars: bool = True) -> str:
    """Text that opens the assistant turn to force a tool call ("" if none), in
    the tokenizer's tool-call format (`tool_parser.opening` / `named_opening`).
    "" where a grammar forces the call instead (`structured.grammar_forces_calls`,
    and `grammars`: the sampler decodes them, `structured.sampler_grammars`)."""
    if grammars and grammar_forces_calls(tokenizer):
        return ""
    parser = getattr(tokenizer, "tool_parser", None)
    if req.tool_choice == "required":
        return parser.opening if parser is not None else TOOL_CALL_OPEN + "\n"
    if req.forced_tool is not None:
        if parser is not None:
            return parser.named_opening(req.forced_tool)
        return TOOL_CALL_OPEN + "\n" + '{"name": ' + json.dumps(req.forced_tool) + ', "arguments": '
    return ""


def model_adapter(ctx: ServeContext, name: str) -> str | None:
    """The LoRA adapter a request's `model` names: None for the served model's name,
    `a` for "<model_name>@a" (an adapter the sampler serves: `Sampler.adapters`);
    404 model_not_found for anything else."""
    base, at, adapter = str(name).partition("@")
    served = served_adapters(ctx.sampler)
    if base == ctx.model_name and not at:
        return None
    if base == ctx.model_name and adapter in served:
        return adapter
    names = [ctx.model_name, *(f"{ctx.model_name}@{a}" for a in served)]
    raise APIError(
        404,
        f"The model {name!r} does not exist; this server serves {', '.join(map(repr, names))}",
        param="model",
        code="model_not_found",
    )


def check_model(ctx: ServeContext, name: str) -> None:
    model_adapter(ctx, name)


def served_adapters(sampler) -> list[str]:
    """The adapters `sampler` serves by name ([] for one without `adapters()`)."""
    adapters = getattr(sampler, "adapters", None)
    return list(adapters()) if callable(adapters) else []


def system_prompt(req: req_lib.GenerationRequest) -> str | None:
    """The text of a chat request's first message when it is a system message."""
    messages = getattr(req, "messages", None) or []
    if not messages or messages[0].get("role") != "system":
        return None
    content = messages[0].get("content")
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else None


def agent_label(request: Request, req: req_lib.GenerationRequest) -> str:
    """The X-Agent header, else the request's `agent` field, else the first of the
    rollout's `agent_rules` its system prompt matches, else "main"."""
    agent = request.headers.get(AGENT_HEADER) or req.agent
    rollout = getattr(request.state, "rollout", None)
    if not agent and rollout is not None and rollout.agent_rules:
        system = system_prompt(req)
        agent = next((r.agent for r in rollout.agent_rules if r.matches(system)), None)
    agent = agent or "main"
    if len(agent) > req_lib.MAX_AGENT_LEN:
        raise bad_request(
            f"agent label is longer than {req_lib.MAX_AGENT_LEN} characters", param="X-Agent"
        )
    return agent


def context_hint(prompt_len: int) -> int:
    """A --max_context that fits `prompt_len` with room to answer: the power of two at
    least prompt_len + 4096."""
    need = prompt_len + 4096
    return 1 << (need - 1).bit_length()


def sampling_params(
    ctx: ServeContext,
    prompt_len: int,
    req: req_lib.GenerationRequest,
    constraint: str | None = None,
) -> list[SamplingParams]:
    """One SamplingParams per choice, max_tokens capped by the context left;
    `constraint`: the grammar of the answer (`structured.request_constraint`)."""
    max_context = ctx.sampler.max_context
    if prompt_len >= max_context:
        raise bad_request(
            f"This model's maximum context length is {max_context} tokens, but the prompt "
            f"has {prompt_len} tokens (and at least one output token is needed): start the "
            f"server with a larger --max_context (python -m ac2_jax.serving "
            f"--max_context={context_hint(prompt_len)}) or send a shorter prompt",
            param="messages",
            code="context_length_exceeded",
        )
    room = max_context - prompt_len
    max_tokens = min(req.max_tokens or ctx.default_max_tokens or room, room)
    try:
        base = SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            max_tokens=max_tokens,
            stop=req.stop,
            stop_token_ids=ctx.tokenizer.stop_token_ids,
            seed=req.seed,
            top_logprobs=req.top_logprobs,
            constraint=constraint,
            adapter=model_adapter(ctx, req.model),
        )
        return [base if req.seed is None else base.replace(seed=req.seed + i) for i in range(req.n)]
    except ValueError as e:  # the request's fields were checked by `schemas` already
        raise bad_request(f"The sampling parameters were refused: {e}") from None


async def until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def abort(ctx: ServeContext, st: RequestState) -> None:
    """The client left: its samples are cancelled and counted as aborted."""
    st.gen.cancel()
    if st.principal.rollout is not None:
        ctx.registry.count(st.principal.rollout, "aborted_completions", st.req.n)


async def forced_prefix_ids(ctx: ServeContext, req: req_lib.ChatRequest) -> tuple[str, list[int]]:
    """The forced tool-call opening of a chat request for this server's sampler
    (`forced_prefix`) and its token ids: what `start_request` appends to the prompt
    (and /v1/messages/count_tokens counts)."""
    prefix = forced_prefix(ctx.tokenizer, req, sampler_grammars(ctx.sampler))
    return prefix, (await asyncio.to_thread(ctx.tokenizer.encode, prefix) if prefix else [])


async def start_request(
    ctx: ServeContext,
    request: Request,
    principal,
    req,
    agent: str,
    prompt_ids: list[int],
    messages: list[dict] | None,
    chat: bool,
) -> RequestState:
    """Adds the forced prefix or the answer's grammar, builds the params and
    starts the samples."""
    grammars = sampler_grammars(ctx.sampler)
    prefix, prefix_ids = await forced_prefix_ids(ctx, req) if chat else ("", [])
    constraint = (
        await asyncio.to_thread(request_constraint, ctx.tokenizer, req, grammars) if chat else None
    )
    full_prompt = list(prompt_ids) + prefix_ids
    params = sampling_params(ctx, len(full_prompt), req, constraint)
    route = principal.rollout.rollout_id if principal.rollout is not None else None
    response_id = chat_lib.new_id("chatcmpl" if chat else "cmpl")
    t0 = time.monotonic()
    feed = TokenFeed() if req.stream else None
    gen = Generation(ctx.sampler, full_prompt, params, feed, route)
    return RequestState(
        request=request,
        principal=principal,
        req=req,
        agent=agent,
        prompt_ids=full_prompt,
        messages=messages,
        chat=chat,
        gen=gen,
        parse_tools=chat and req.parse_tools,
        prefix=prefix,
        prefix_ids=prefix_ids,
        t0=t0,
        response_id=response_id,
        constraint=constraint,
    )


def serve_stream(
    ctx: ServeContext, st: RequestState, writer: EventWriter | None = None
) -> WatchedStreamingResponse:
    async def on_close(_completed: bool) -> None:
        if not st.gen.settled:
            abort(ctx, st)

    body = stream_events(ctx, st, writer)
    return WatchedStreamingResponse(body, on_close=on_close, media_type="text/event-stream")


def openai_render(ctx: ServeContext) -> Render:
    """Chat / text completion bodies (the two OpenAI routes)."""

    def render(st: RequestState, choices: list[chat_lib.Choice], version: int) -> dict:
        build = chat_lib.chat_response if st.chat else chat_lib.completion_response
        return build(
            ctx.model_name,
            choices,
            len(st.prompt_ids),
            ctx.tokenizer,
            st.req,
            version,
            st.response_id,
        )

    return render


async def serve_plain(
    ctx: ServeContext, st: RequestState, render: Render | None = None
) -> JSONResponse:
    """Samples, records and answers one non-streaming request (499 if the client left)."""
    gen = st.gen
    work = asyncio.ensure_future(run_generation(ctx, st.principal, gen))
    gone = asyncio.ensure_future(until_disconnect(st.request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        work.cancel()
        abort(ctx, st)
        return JSONResponse({}, status_code=499)  # nobody is listening
    results = work.result()
    gen.settled = True
    choices, turns = await asyncio.to_thread(finish_choices, ctx, results, st)
    await record(ctx, st, choices, time.monotonic() - st.t0, turns)
    version = max(c.result.policy_version for c in choices)
    return JSONResponse((render or openai_render(ctx))(st, choices, version))


async def serve_request(
    ctx: ServeContext,
    st: RequestState,
    render: Render | None = None,
    writer: EventWriter | None = None,
):
    """Answers a started request: the event stream (`writer`, OpenAI chunks by
    default) or, once sampled and recorded, the JSON body `render` makes."""
    if st.req.stream:
        return serve_stream(ctx, st, writer)
    return await serve_plain(ctx, st, render)


async def chat_prompt_ids(ctx: ServeContext, principal, req: req_lib.ChatRequest) -> list[int]:
    """The rendered prompt of a chat request (the rollout's spliced token
    history where it continues one); 400 when the template cannot render it."""
    memory = principal.rollout.memory if principal.rollout else None
    try:
        prompt_ids, _ = await asyncio.to_thread(
            build_prompt_ids, ctx.tokenizer, req.messages, req.tools, memory
        )
    except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:
        raise bad_request(f"Could not render the chat template: {e}", param="messages") from None
    return prompt_ids


def install_generation_routes(
    app: FastAPI, ctx: ServeContext, *, authenticate: Callable, read_json: Callable
) -> None:
    """Adds the two sampling routes to `app` (see the module docstring), serving
    through `ctx` (the one every request API of the app shares)."""
    tokenizer = ctx.tokenizer

    async def serve(request, principal, req, agent, prompt_ids, messages, chat: bool):
        st = await start_request(ctx, request, principal, req, agent, prompt_ids, messages, chat)
        return await serve_request(ctx, st)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        principal = await authenticate(request)
        req = req_lib.parse_chat_request(await read_json(request))
        check_model(ctx, req.model)
        agent = agent_label(request, req)
        prompt_ids = await chat_prompt_ids(ctx, principal, req)
        return await serve(request, principal, req, agent, prompt_ids, req.messages, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        principal = await authenticate(request)
        req = req_lib.parse_completion_request(await read_json(request))
        check_model(ctx, req.model)
        agent = agent_label(request, req)
        if isinstance(req.prompt, str):
            prompt_ids = await asyncio.to_thread(tokenizer.encode, req.prompt)
        else:
            prompt_ids = list(req.prompt)
            bad = [t for t in prompt_ids if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise bad_request(
                    f"'prompt' has token ids outside [0, {tokenizer.vocab_size}): {bad[:5]}",
                    param="prompt",
                )
        if not prompt_ids:
            raise bad_request("'prompt' encodes to no tokens", param="prompt")
        return await serve(request, principal, req, agent, prompt_ids, None, chat=False)
