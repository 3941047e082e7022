"""The OpenAI-compatible endpoint and the rollout lifecycle API (FastAPI).

Routes
  POST /v1/chat/completions   messages, tools, n, logprobs/top_logprobs,
                              max_tokens/max_completion_tokens, temperature,
                              top_p, stop, seed, stream (SSE, `data: [DONE]`)
  POST /v1/completions        prompt (text or token ids), same sampling fields
  GET  /v1/models
  POST /v1/rollouts                 (admin) {task_id, group_id?, attempt_id?,
                                    metadata?, timeout_s?} -> {rollout_id, base_url, api_key}
  GET  /v1/rollouts/{id}            status, completions so far, tokens, policy versions
  POST /v1/rollouts/{id}/finish     (admin) {reward?, artifacts?, status?, hints?, metrics?};
                                    (rollout key) {} or {status: "finished"} only: stops
                                    the rollout (key spent); the admin still grades it and
                                    it is stored once, when final
  GET  /v1/rollouts/{id}/trace      the trace JSON (`Trace.to_dict()`)

Auth is `Authorization: Bearer <key>`. The admin key reaches everything and
its completions are not recorded. A rollout key reaches only its own rollout;
its completions are recorded under the agent label from the `X-Agent` header,
else the request's `metadata.agent` or `user`, else "main". The harness (so
often the policy) holds that key, so it may end its rollout but not grade it:
reward, other statuses, metrics, hints and artifacts are admin-only (403), and
it reads its rollout and trace without the metadata, hints and metrics. A
rollout key gets the same 403 for any other rollout id, existing or not. Every
error is an OpenAI error object and leaves stored state unchanged.

Streaming sends the finished result as SSE chunks: the Sampler protocol
returns whole results, so chunks arrive once sampling is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ac2_jax.models.tokenizer import Tokenizer
from ac2_jax.sampling import ContextLengthError, Sampler, SamplingParams, truncate_at_stop
from ac2_jax.serving import chat as chat_lib
from ac2_jax.serving.errors import APIError, bad_request, install_error_handlers
from ac2_jax.serving.rollouts import (Rollout, RolloutRegistry, check_rollout_key_finish,
                                      keys_equal, parse_create, parse_finish, rollout_key_view)
from ac2_jax.serving.splice import build_prompt_ids
from ac2_jax.trace import Completion, TraceStore

AGENT_HEADER = "x-agent"
_MAX_AGENT_LEN = 128


class _Principal:
    """Who is calling: the admin (rollout None) or one running rollout."""

    def __init__(self, rollout: Rollout | None):
        self.rollout = rollout

    @property
    def is_admin(self) -> bool:
        return self.rollout is None


def build_app(sampler: Sampler, tokenizer: Tokenizer, *, admin_key: str,
              trace_store: TraceStore | str | None = None, model_name: str = "ac2-policy",
              rollout_timeout_s: float | None = None, default_max_tokens: int | None = None,
              sweep_interval_s: float = 1.0, max_finished_rollouts: int = 10_000) -> FastAPI:
    """The endpoint app. `app.state.registry` holds the rollouts.

    trace_store: a TraceStore or a JSONL path; finished traces are appended.
    rollout_timeout_s: default timeout of a rollout (None = none).
    default_max_tokens: used when a request sets no max_tokens (None = the
    rest of the context).
    sweep_interval_s: how often running rollouts are checked for timeouts.
    max_finished_rollouts: finished rollouts kept in memory for GET (oldest
    dropped first; their traces stay in the store).
    """
    if not admin_key:
        raise ValueError("build_app: admin_key must be a non-empty string")
    if isinstance(trace_store, str):
        trace_store = TraceStore(trace_store)
    registry = RolloutRegistry(trace_store, default_timeout_s=rollout_timeout_s,
                               max_finished=max_finished_rollouts)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        async def sweeper():
            while True:
                await asyncio.sleep(sweep_interval_s)
                registry.sweep()

        task = asyncio.create_task(sweeper())
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(title="ac2_jax OpenAI-compatible endpoint", lifespan=lifespan)
    app.state.registry = registry
    app.state.sampler = sampler
    app.state.tokenizer = tokenizer
    app.state.model_name = model_name

    def end_as_infra_error(request: Request, exc: Exception) -> None:
        """A crash while serving a rollout's request (sampler, server) is our fault:
        the rollout ends as infra_error, so it is never trained."""
        rollout = getattr(request.state, "rollout", None)
        if rollout is None or not rollout.running:
            return
        try:
            registry.finish(rollout, status="infra_error",
                            artifacts={"error": f"{type(exc).__name__}: {exc}"})
        except Exception:  # noqa: BLE001 - e.g. it ended meanwhile; the 500 goes out anyway
            logging.exception("could not end rollout %s as infra_error", rollout.rollout_id)

    install_error_handlers(app, on_crash=end_as_infra_error)

    def authenticate(request: Request) -> _Principal:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "Missing API key: send 'Authorization: Bearer <key>'",
                           code="missing_api_key")
        if keys_equal(key, admin_key):
            return _Principal(None)
        rollout = registry.by_key(key)
        if rollout is None:
            raise APIError(401, "Invalid API key", code="invalid_api_key")
        request.state.rollout = rollout  # for end_as_infra_error
        return _Principal(rollout)

    def owned_rollout(principal: _Principal, rollout_id: str) -> Rollout:
        # Checked before the lookup: another id is refused alike whether it exists or not.
        if not principal.is_admin and principal.rollout.rollout_id != rollout_id:
            raise APIError(403, f"This API key belongs to rollout {principal.rollout.rollout_id}"
                           f" and cannot access rollout {rollout_id}", code="wrong_rollout")
        return registry.get(rollout_id)

    def view(principal: _Principal, data: dict[str, Any]) -> dict[str, Any]:
        return data if principal.is_admin else rollout_key_view(data)

    async def read_json(request: Request) -> Any:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"Malformed JSON in request body: {e}", code="invalid_json") from None

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(404, f"The model {name!r} does not exist; this server serves "
                           f"{model_name!r}", param="model", code="model_not_found")

    def agent_label(request: Request, req: chat_lib.GenerationRequest) -> str:
        agent = request.headers.get(AGENT_HEADER) or req.agent or "main"
        if len(agent) > _MAX_AGENT_LEN:
            raise bad_request(f"agent label is longer than {_MAX_AGENT_LEN} characters",
                              param="user")
        return agent

    async def sample(prompt_ids: list[int], req: chat_lib.GenerationRequest):
        max_context = sampler.max_context
        if len(prompt_ids) >= max_context:
            raise bad_request(
                f"This model's maximum context length is {max_context} tokens, but the prompt "
                f"has {len(prompt_ids)} tokens (and at least one output token is needed)",
                param="messages", code="context_length_exceeded")
        room = max_context - len(prompt_ids)
        max_tokens = min(req.max_tokens or default_max_tokens or room, room)
        try:
            base = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                  max_tokens=max_tokens, stop=req.stop,
                                  stop_token_ids=tokenizer.stop_token_ids, seed=req.seed,
                                  top_logprobs=req.top_logprobs)
        except ValueError as e:
            raise bad_request(str(e)) from None
        params = [base if req.seed is None else base.replace(seed=req.seed + i)
                  for i in range(req.n)]
        t0 = time.monotonic()
        try:
            results = await asyncio.gather(*(sampler.generate(prompt_ids, p) for p in params))
        except ContextLengthError as e:
            raise bad_request(str(e), param="messages", code="context_length_exceeded") from None
        except ValueError as e:
            raise bad_request(f"The sampler rejected the request: {e}") from None
        elapsed = time.monotonic() - t0
        return [truncate_at_stop(r, req.stop, tokenizer.decode) for r in results], elapsed

    def record(principal, request, req, prompt_ids, choices, elapsed, messages=None, turns=()):
        if principal.rollout is None:
            return
        comps = [Completion(prompt_ids=list(prompt_ids), output_ids=list(c.result.output_ids),
                            output_logprobs=[float(x) for x in c.result.output_logprobs],
                            policy_version=int(c.result.policy_version),
                            finish_reason=c.finish_reason, timings={"sample_s": elapsed},
                            cached_tokens=int(c.result.cached_tokens), messages=messages,
                            temperature=float(req.temperature), top_k=int(req.top_k),
                            top_p=float(req.top_p))
                 for c in choices]
        registry.record(principal.rollout, agent_label(request, req), comps, list(turns))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        principal = authenticate(request)
        req = chat_lib.parse_chat_request(await read_json(request))
        check_model(req.model)
        agent_label(request, req)  # validate before sampling
        memory = principal.rollout.memory if principal.rollout else None
        try:
            prompt_ids, _ = build_prompt_ids(tokenizer, req.messages, req.tools, memory)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:
            raise bad_request(f"Could not render the chat template: {e}",
                              param="messages") from None
        results, elapsed = await sample(prompt_ids, req)
        parse_tools = bool(req.tools) and req.tool_choice != "none"
        choices = [chat_lib.choice_from_result(i, r, m, tokenizer, parse_tools)
                   for i, (r, m) in enumerate(results)]
        turns = [(c.content, c.tool_calls, c.result.output_ids) for c in choices]
        record(principal, request, req, prompt_ids, choices, elapsed, req.messages, turns)
        version = max(c.result.policy_version for c in choices)
        if req.stream:
            return StreamingResponse(chat_lib.chat_stream_events(
                model_name, choices, len(prompt_ids), tokenizer, req, version),
                media_type="text/event-stream")
        return JSONResponse(chat_lib.chat_response(model_name, choices, len(prompt_ids),
                                                   tokenizer, req, version))

    @app.post("/v1/completions")
    async def completions(request: Request):
        principal = authenticate(request)
        req = chat_lib.parse_completion_request(await read_json(request))
        check_model(req.model)
        agent_label(request, req)
        if isinstance(req.prompt, str):
            prompt_ids = tokenizer.encode(req.prompt)
        else:
            prompt_ids = list(req.prompt)
            bad = [t for t in prompt_ids if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise bad_request(f"'prompt' has token ids outside [0, {tokenizer.vocab_size}): "
                                  f"{bad[:5]}", param="prompt")
        if not prompt_ids:
            raise bad_request("'prompt' encodes to no tokens", param="prompt")
        results, elapsed = await sample(prompt_ids, req)
        choices = [chat_lib.choice_from_result(i, r, m, tokenizer, False)
                   for i, (r, m) in enumerate(results)]
        record(principal, request, req, prompt_ids, choices, elapsed)
        version = max(c.result.policy_version for c in choices)
        if req.stream:
            return StreamingResponse(chat_lib.completion_stream_events(
                model_name, choices, len(prompt_ids), tokenizer, req, version),
                media_type="text/event-stream")
        return JSONResponse(chat_lib.completion_response(model_name, choices, len(prompt_ids),
                                                         tokenizer, req, version))

    @app.get("/v1/models")
    async def models(request: Request):
        authenticate(request)
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": 0, "owned_by": "ac2_jax",
            "max_model_len": sampler.max_context, "policy_version": sampler.policy_version}]}

    @app.post("/v1/rollouts")
    async def create_rollout(request: Request):
        principal = authenticate(request)
        if not principal.is_admin:
            raise APIError(403, "Only the admin key can create rollouts", code="admin_only")
        args = parse_create(await read_json(request))
        rollout = registry.create(**args)
        base_url = str(request.base_url).rstrip("/") + "/v1"
        return {"rollout_id": rollout.rollout_id, "base_url": base_url,
                "api_key": rollout.api_key, "model": model_name,
                "task_id": rollout.trace.task_id, "attempt_id": rollout.trace.attempt_id,
                "group_id": rollout.trace.group_id}

    @app.get("/v1/rollouts/{rollout_id}")
    async def rollout_status(rollout_id: str, request: Request):
        principal = authenticate(request)
        return view(principal, registry.summary(owned_rollout(principal, rollout_id)))

    @app.post("/v1/rollouts/{rollout_id}/finish")
    async def finish_rollout(rollout_id: str, request: Request):
        principal = authenticate(request)
        rollout = owned_rollout(principal, rollout_id)
        args = parse_finish(await read_json(request))
        if not principal.is_admin:
            check_rollout_key_finish(args)
        try:
            registry.finish(rollout, **args)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - e.g. the trace store's disk
            logging.exception("finishing rollout %s failed", rollout_id)
            raise APIError(500, f"Could not store the trace of {rollout_id}: {e}",
                           code="trace_store_error") from None
        return view(principal, registry.summary(rollout))

    @app.get("/v1/rollouts/{rollout_id}/trace")
    async def rollout_trace(rollout_id: str, request: Request):
        principal = authenticate(request)
        return view(principal, registry.trace_dict(owned_rollout(principal, rollout_id)))

    return app
