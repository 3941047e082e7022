"""The Gemini API (v1beta): what Gemini CLI and the `google-genai` clients speak.

Routes (under /v1beta; errors in Gemini's shape {"error": {"code", "message",
"status"}}, `errors.error_style`; the key from `x-goog-api-key`, `?key=`,
Bearer or x-api-key):
  POST /v1beta/models/{model}:generateContent        one answer
  POST /v1beta/models/{model}:streamGenerateContent  ?alt=sse: server-sent events, each
                                                     `data: <GenerateContentResponse>`
                                                     (text as it is sampled; the function
                                                     calls, finishReason and usageMetadata
                                                     in the last); without alt=sse a 400
  POST /v1beta/models/{model}:countTokens            {"totalTokens": n} of `contents` or a
                                                     `generateContentRequest`, rendered as
                                                     generateContent would render it
                                                     (a history may end with the model's)
  GET  /v1beta/models, /v1beta/models/{model}         the served model (and its adapters)
All of them are served under /v1/models/... too (google-genai 3.x's default
api_version is v1; Gemini CLI uses v1beta): GET /v1/models is the OpenAI list with the
Gemini entries beside it (`models`), GET /v1/models/{model} OpenAI's model object with
the Gemini entry's fields beside it.

A request is translated into the OpenAI chat messages and tools a Chat
Completions client would send for the same conversation (`gemini_schemas`) and
served by the one path of every request API (`chat_prompt_ids`, `start_request`,
`serve_request`): the same chat template, the same splice of the rollout's sampled
ids, the same token-level recording (one episode per append-only conversation,
whatever API carried it). The recorded `Completion.request_id` is the
`responseId` the client sees.

Fields (null is taken as absent):
  contents            honoured: role user | model (| function, as user); parts text,
                      functionCall {name, args, id?} (model), functionResponse {name,
                      response, id?} (user: a tool message, before the content's text;
                      matched to its call by id, else to the earliest unanswered call
                      of that name; none, or an id's call of another name: 400).
                      thoughtSignature: accepted, never rendered. Refused by name:
                      inlineData / fileData (text-only model), executableCode /
                      codeExecutionResult, thought true; a last content from the model
                      (prefill; countTokens counts such a history).
  systemInstruction   honoured: its text parts (joined by "\\n") are the system message.
  tools               functionDeclarations honoured {name, description, parameters (a
                      Gemini Schema: types lower-cased, nullable as a union with
                      null, propertyOrdering dropped, TYPE_UNSPECIFIED refused) or
                      parametersJsonSchema}; response schemas accepted, not rendered;
                      googleSearch, googleSearchRetrieval, urlContext, retrieval, fileSearch,
                      googleMaps (grounding), codeExecution, computerUse refused by name.
  toolConfig          functionCallingConfig.mode AUTO -> tool_choice auto, NONE -> none,
                      ANY -> required, ANY + allowedFunctionNames [one] -> that function
                      (forced calls decoded as the chat route does, `structured`).
  generationConfig    temperature (0 greedy), topP, topK, maxOutputTokens, stopSequences,
                      seed honoured; candidateCount 1 only; responseMimeType
                      application/json (+ responseSchema / responseJsonSchema) decoded
                      under the grammar (response_format); thinkingConfig accepted (this
                      model never thinks: no thought parts); responseModalities [TEXT];
                      penalties, logprobs, speech and media settings refused.
  safetySettings      accepted only with thresholds meaning no filtering (BLOCK_NONE, OFF,
                      HARM_BLOCK_THRESHOLD_UNSPECIFIED): there is no safety filter here,
                      so any other threshold is refused by name.
  labels              accepted, no effect (nothing billed).
  cachedContent       refused (send the content; prefix caching is automatic).
  agent               extension: the agent label (the X-Agent header wins, else "main").
Any other field is a 400 naming it.

The answer: candidates [{content: {role: model, parts: [text?, functionCall {name,
args, id}...]}, finishReason STOP | MAX_TOKENS, index 0}], usageMetadata
{promptTokenCount (the whole prompt), candidatesTokenCount, totalTokenCount,
cachedContentTokenCount (reused from the prefix cache)}, modelVersion, responseId.
A call whose arguments are no JSON object comes back as args {"arguments": <text>}.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ac2_jax.sampling import SampleResult
from ac2_jax.serving.apis.gemini.schemas import CountTokensBody, GenerateBody
from ac2_jax.serving.apis.messages._output import tool_input
from ac2_jax.serving.core import chat as chat_lib
from ac2_jax.serving.core import requests as req_lib
from ac2_jax.serving.core.errors import APIError, bad_request
from ac2_jax.serving.core.generation import (
    agent_label,
    chat_prompt_ids,
    check_model,
    forced_prefix_ids,
    serve_request,
    served_adapters,
    start_request,
)
from ac2_jax.serving.core.sample_run import RequestState, ServeContext
from ac2_jax.serving.core.schemas import validate
from ac2_jax.serving.core.stream_generation import EventWriter
from ac2_jax.serving.core.streaming import TextStream
from ac2_jax.serving.core.structured import response_schema, sampler_grammars

__all__ = ["GeminiWriter", "chat_request", "install_gemini_routes"]

METHODS = ("generateContent", "streamGenerateContent", "countTokens")


def chat_request(body: GenerateBody, model: str, stream: bool) -> req_lib.ChatRequest:
    """The ChatRequest a Chat Completions client would send for `body` (`model`: the
    one the path names; a body's own `model` must agree)."""
    if body.model is not None and body.model.removeprefix("models/") != model:
        raise bad_request(
            f"'model' is {body.model!r} but the path names {model!r}; send one model",
            param="model",
        )
    try:
        messages = req_lib.normalize_messages(body.chat_messages())
    except ValueError as e:
        raise bad_request(str(e), param="contents") from None
    cfg = body.generation_config
    fcc = body.tool_config.function_calling_config if body.tool_config else None
    mode = (fcc.mode if fcc else None) or "AUTO"
    tool_choice: str | dict | None = None
    forced = None
    tools = body.chat_tools()
    if mode in ("ANY", "NONE") and not tools:
        raise bad_request(
            f"toolConfig.functionCallingConfig.mode {mode} needs functionDeclarations in tools",
            param="toolConfig.functionCallingConfig.mode",
        )
    if mode == "NONE":
        tool_choice = "none"
    elif mode == "ANY":
        names = fcc.allowed_function_names if fcc else None
        declared = [d.name for d in body.declarations()]
        if names:
            if names[0] not in declared:
                raise bad_request(
                    f"allowedFunctionNames names {names[0]!r}, which is not declared ({declared})",
                    param="toolConfig.functionCallingConfig.allowedFunctionNames",
                )
            forced = names[0]
            tool_choice = {"type": "function", "function": {"name": forced}}
        else:
            tool_choice = "required"
    return req_lib.ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        forced_tool=forced,
        response_format=cfg.response_format() if cfg else None,
        max_tokens=cfg.max_output_tokens if cfg else None,
        temperature=1.0 if cfg is None or cfg.temperature is None else float(cfg.temperature),
        top_p=1.0 if cfg is None or cfg.top_p is None else float(cfg.top_p),
        top_k=-1 if cfg is None or cfg.top_k is None else int(cfg.top_k),
        stop=tuple((cfg.stop_sequences if cfg else None) or ()),
        seed=cfg.seed if cfg else None,
        stream=stream,
        agent=body.agent,
    )


# ------------------------------------------------------------------------------ answers


def new_response_id() -> str:
    return "gem_" + uuid.uuid4().hex[:24]


def finish_reason(choice: chat_lib.Choice) -> str:
    return "MAX_TOKENS" if choice.finish_reason == "length" else "STOP"


def call_parts(choice: chat_lib.Choice) -> list[dict[str, Any]]:
    return [
        {
            "functionCall": {
                "name": call["function"]["name"],
                "args": tool_input(call["function"]["arguments"]),
                "id": call["id"],
            }
        }
        for call in choice.tool_calls
    ]


def usage_metadata(st: RequestState, result: SampleResult) -> dict[str, int]:
    prompt, out = len(st.prompt_ids), len(result.output_ids)
    return {
        "promptTokenCount": prompt,
        "candidatesTokenCount": out,
        "totalTokenCount": prompt + out,
        "cachedContentTokenCount": min(int(result.cached_tokens), prompt),
    }


def chunk(
    ctx: ServeContext,
    st: RequestState,
    parts: list[dict],
    finish: str | None = None,
    usage: dict | None = None,
) -> dict[str, Any]:
    candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
    if finish is not None:
        candidate["finishReason"] = finish
    out: dict[str, Any] = {"candidates": [candidate]}
    if usage is not None:
        out["usageMetadata"] = usage
    out["modelVersion"] = ctx.model_name
    out["responseId"] = st.response_id
    return out


def response_body(ctx: ServeContext, st: RequestState, choice: chat_lib.Choice) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    if choice.content or not choice.tool_calls:
        parts.append({"text": choice.content or ""})
    parts += call_parts(choice)
    return chunk(ctx, st, parts, finish_reason(choice), usage_metadata(st, choice.result))


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\r\n\r\n"


class GeminiWriter(EventWriter):
    """streamGenerateContent?alt=sse: a chunk per piece of text as it is sampled, then
    one with the rest of the text, the function calls, finishReason and usageMetadata;
    an error once the stream is open is `data: {"error": ...}` and the stream ends."""

    def __init__(self, ctx: ServeContext, st: RequestState):
        self.ctx, self.st = ctx, st

    def opening(self) -> Iterable[str]:
        return ()

    def delta(self, index: int, text: str, part: SampleResult | None) -> Iterable[str]:
        if text:
            yield sse(chunk(self.ctx, self.st, [{"text": text}]))

    def final(self, choices: list, streams: list[TextStream]) -> Iterable[str]:
        (choice,), (stream,) = choices, streams
        rest = stream.rest(choice.content)
        parts = ([{"text": rest}] if rest else []) + call_parts(choice)
        usage = usage_metadata(self.st, choice.result)
        yield sse(chunk(self.ctx, self.st, parts, finish_reason(choice), usage))

    def error(self, err: APIError) -> Iterable[str]:
        yield sse(err.gemini_body())


# ------------------------------------------------------------------------------ routes


def model_entry(ctx: ServeContext, name: str) -> dict[str, Any]:
    return {
        "name": f"models/{name}",
        "baseModelId": ctx.model_name,
        "version": str(ctx.sampler.policy_version),
        "displayName": name,
        "description": "The policy served by ac2_jax",
        "inputTokenLimit": ctx.sampler.max_context,
        "outputTokenLimit": ctx.sampler.max_context,
        "supportedGenerationMethods": list(METHODS),
    }


def gemini_models(ctx: ServeContext) -> list[dict[str, Any]]:
    """The served model and its adapters as Gemini API model entries."""
    names = [ctx.model_name, *(f"{ctx.model_name}@{a}" for a in served_adapters(ctx.sampler))]
    return [model_entry(ctx, n) for n in names]


def _model_of(target: str) -> tuple[str, str]:
    """("tiny", "generateContent") of "tiny:generateContent" (a "models/" prefix allowed)."""
    name, colon, method = target.removeprefix("models/").rpartition(":")
    if not colon or method not in METHODS:
        raise APIError(
            404,
            f"Unknown method {method or target!r}: POST /v1beta/models/<model>:<method>, "
            f"method one of {list(METHODS)}",
            code="method_not_found",
        )
    return name, method


def install_gemini_routes(
    app: FastAPI, ctx: ServeContext, *, authenticate: Callable, read_json: Callable
) -> None:
    """Adds the Gemini API routes (see the module docstring) to `app`."""

    @app.get("/v1beta/models")
    async def list_models(request: Request):
        await authenticate(request)
        return {"models": gemini_models(ctx)}

    @app.get("/v1beta/models/{model}")
    async def get_model(model: str, request: Request):
        await authenticate(request)
        check_model(ctx, model)
        return model_entry(ctx, model)

    @app.get("/v1/models/{model}")
    async def get_model_v1(model: str, request: Request):
        """OpenAI's model object (the openai client's models.retrieve) with the Gemini
        entry's fields beside it (google-genai's models.get at api_version v1)."""
        await authenticate(request)
        check_model(ctx, model)
        openai_entry = {
            "id": model,
            "object": "model",
            "created": 0,
            "owned_by": "ac2_jax",
            "max_model_len": ctx.sampler.max_context,
            "policy_version": ctx.sampler.policy_version,
        }
        return {**openai_entry, **model_entry(ctx, model)}

    @app.post("/v1beta/models/{target:path}")
    @app.post("/v1/models/{target:path}")  # google-genai 3.x's default api_version is v1
    async def model_method(target: str, request: Request):
        principal = await authenticate(request)
        model, method = _model_of(target)
        check_model(ctx, model)
        payload = await read_json(request)
        if method == "countTokens":
            counted = validate(CountTokensBody, payload).generate_body()
            req = chat_request(counted, model, stream=False)
            prompt_ids = await chat_prompt_ids(ctx, principal, req)
            _prefix, prefix_ids = await forced_prefix_ids(ctx, req)
            return JSONResponse({"totalTokens": len(prompt_ids) + len(prefix_ids)})
        stream = method == "streamGenerateContent"
        if stream and request.query_params.get("alt") != "sse":
            raise bad_request(
                "streamGenerateContent is served as server-sent events only: add ?alt=sse",
                param="alt",
            )
        body = validate(GenerateBody, payload)
        req = chat_request(body, model, stream)
        if response_schema(req.response_format) is not None and not sampler_grammars(
            ctx.sampler
        ):  # refused here so that the message names the Gemini fields
            raise bad_request(
                "generationConfig.responseMimeType application/json (a JSON answer) needs "
                "grammar-constrained decoding, which this server's sampler does not do "
                "(SGLang: its grammar backends' masks cannot be replayed by the learner); "
                "send text/plain or serve with the embedded JaxSampler",
                param="generationConfig.responseMimeType",
            )
        agent = agent_label(request, req)
        prompt_ids = await chat_prompt_ids(ctx, principal, req)
        st = await start_request(
            ctx, request, principal, req, agent, prompt_ids, req.messages, chat=True
        )
        st.response_id = new_response_id()  # before anything is sent or recorded

        def render(st: RequestState, choices: list[chat_lib.Choice], _version: int) -> dict:
            (choice,) = choices
            return response_body(ctx, st, choice)

        writer = GeminiWriter(ctx, st) if stream else None
        return await serve_request(ctx, st, render, writer)
