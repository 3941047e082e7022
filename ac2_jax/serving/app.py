"""The OpenAI-compatible endpoint and the rollout lifecycle API (FastAPI).

Routes
  POST /v1/chat/completions   messages, tools, n, logprobs/top_logprobs,
                              max_tokens/max_completion_tokens, temperature,
                              top_p, stop, seed, stream (SSE, `data: [DONE]`)
  POST /v1/completions        prompt (text or token ids), same sampling fields
  POST /v1/messages           the Anthropic Messages API (`messages`: blocks, tools,
                              tool_choice, stop_sequences, streaming in Anthropic's
                              events, Anthropic-shaped errors); /v1/messages/count_tokens
  POST /v1beta/models/{model}:generateContent | :streamGenerateContent (?alt=sse) |
       :countTokens; GET /v1beta/models[/{model}]   the Gemini API (`gemini`: contents,
                              systemInstruction, functionDeclarations, Gemini-shaped
                              errors; the key also from x-goog-api-key or ?key=)
  POST /v1/responses          the OpenAI Responses API (`responses`: input items,
                              function tools, previous_response_id chains per rollout,
                              streaming events); GET /v1/responses/{id}
                              Every sampling route renders through the model's chat
                              template into the same token-level recording (one episode
                              per append-only conversation, whatever API carried it);
                              tool_choice required / named and JSON output formats are
                              decoded under a grammar (`structured`)
  GET  /v1/models                   (the admin also gets `sampler_stats`: compiled shapes and
                                    errors; for a FleetSampler each backend's health and load)
  POST /v1/rollouts                 (admin) {task_id, group_id?, attempt_id?,
                                    metadata?, timeout_s?, agent_rules?} -> {rollout_id, base_url
                                    (OpenAI), anthropic_base_url, gemini_base_url, api_key}
  GET  /v1/rollouts/{id}            status, completions so far, tokens, policy versions
  POST /v1/rollouts/{id}/finish     (admin) {reward?, artifacts?, status?, hints?, metrics?};
                                    (rollout key) {} or {status: "finished"} only: stops
                                    the rollout (key spent); the admin still grades it and
                                    it is stored once, when final
  GET  /v1/rollouts/{id}/trace      the trace JSON (`Trace.to_dict()`)
  POST /v1/admin/load_weights       (admin) {step, learner_step?}: the sampler loads published
                                    `step` (`load_weights`, off the event loop) -> {policy_version,
                                    learner_step}; 404 when the step is not published, 409 when
                                    the sampler cannot take it (no publish dir, another
                                    architecture); a failed load leaves the served weights as
                                    they were. `learner_step` (loop steps a learner in another
                                    process has finished) is shown to the admin in /v1/models:
                                    a split collector paces itself on it (`training.rl.split`)

Finished rollouts past `max_finished_rollouts` leave memory: the admin still
gets their status (a summary without the per-completion list, `evicted: true`)
and their trace (read back from the trace store).

Auth is `Authorization: Bearer <key>` or `x-api-key: <key>` (what Anthropic
clients send; Bearer wins when both are present). The admin key reaches everything and
its completions are not recorded. A rollout key reaches only its own rollout;
its completions are recorded under the agent label from the `X-Agent` header,
else the request's top-level `agent` extension field, else the first of the
rollout's `agent_rules` (create call: [{agent, system_regex | system_sha256}])
its system prompt matches, else "main" (OpenAI's `user` is an end-user id and
never the label). The harness (so often the
policy) holds that key, so it may end its rollout but not grade it: reward,
other statuses, metrics, hints and artifacts are admin-only (403), and it
reads its rollout and trace without the metadata, hints and metrics. A
rollout key gets the same 404 for any other rollout id, existing or not.
Every error is an OpenAI error object and leaves stored state unchanged; a
500 says nothing of its cause (that goes to the server log).

Bodies are strict JSON (`requests.read_json`): NaN/Infinity, non-UTF-8 and
nesting past `max_json_depth` are 400s, bodies past `max_body_bytes` 413.
The sampling routes are in `generation` (streaming, disconnects, tool_choice).
/docs, /redoc and /openapi.json exist only with `expose_docs=True`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from fastapi import FastAPI, Request

from ac2_jax.models.tokenizer import Tokenizer
from ac2_jax.sampling import Sampler, SamplerError
from ac2_jax.serving import requests as req_lib
from ac2_jax.serving.errors import APIError, install_error_handlers
from ac2_jax.serving.gemini import gemini_models, install_gemini_routes
from ac2_jax.serving.generation import install_generation_routes, served_adapters
from ac2_jax.serving.messages import install_messages_routes
from ac2_jax.serving.responses import install_responses_routes
from ac2_jax.serving.rollout_requests import (
    check_rollout_key_finish,
    keys_equal,
    parse_create,
    parse_finish,
    parse_load_weights,
    rollout_key_view,
)
from ac2_jax.serving.rollouts import Rollout, RolloutRegistry
from ac2_jax.trace import TraceStore


class _Principal:
    """Who is calling: the admin (rollout None) or one running rollout."""

    def __init__(self, rollout: Rollout | None):
        self.rollout = rollout

    @property
    def is_admin(self) -> bool:
        return self.rollout is None


def sampler_stats(sampler: Sampler) -> dict[str, Any] | None:
    """What the admin sees of the sampler: a fleet's `status()` (each backend's
    health and load), a JaxSampler's compile set and errors, an SGLang
    client's counters; None for a sampler with none of these."""
    status = getattr(sampler, "status", None)
    if callable(status):
        return status()
    stats = getattr(sampler, "stats", None)
    if isinstance(stats, dict):
        return dict(stats)
    if stats is None:
        return None
    return {
        "compiled_shapes": stats.compiled_shapes,
        "output_tokens": stats.output_tokens,
        "request_errors": stats.request_errors,
        "worker_restarts": stats.worker_restarts,
    }


def build_app(
    sampler: Sampler,
    tokenizer: Tokenizer,
    *,
    admin_key: str,
    trace_store: TraceStore | str | None = None,
    model_name: str = "ac2-policy",
    rollout_timeout_s: float | None = None,
    default_max_tokens: int | None = None,
    sweep_interval_s: float = 1.0,
    max_finished_rollouts: int = 256,
    max_body_bytes: int = req_lib.MAX_BODY_BYTES,
    max_json_depth: int = req_lib.MAX_JSON_DEPTH,
    expose_docs: bool = False,
    builtin_tools: str = "omit",
) -> FastAPI:
    """The endpoint app. `app.state.registry` holds the rollouts.

    trace_store: a TraceStore or a JSONL path; finished traces are appended.
    rollout_timeout_s: default timeout of a rollout (None = none).
    default_max_tokens: used when a request sets no max_tokens (None = the
    rest of the context).
    sweep_interval_s: how often running rollouts are checked for timeouts.
    max_finished_rollouts: finished rollouts whose whole trace stays in memory
    (oldest dropped first; their traces stay in the store and a small summary
    still answers their status, see `RolloutRegistry`).
    max_body_bytes: larger request bodies get 413. max_json_depth: deeper
    JSON gets 400. expose_docs: serve /docs, /redoc and /openapi.json.
    builtin_tools: what /v1/responses does with built-in tools (web_search, ...) it
    cannot run: "omit" (default: leave them out of the model's prompt, counted in the
    rollout's `builtin_tools_omitted` and named in its trace metadata's `omitted_tools`;
    Codex's default request offers web_search) or "refuse" (a 400 naming the tool).
    """
    if not admin_key:
        raise ValueError("build_app: admin_key must be a non-empty string")
    if isinstance(trace_store, str):
        trace_store = TraceStore(trace_store)
    registry = RolloutRegistry(
        trace_store, default_timeout_s=rollout_timeout_s, max_finished=max_finished_rollouts
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        async def sweeper():
            while True:
                await asyncio.sleep(sweep_interval_s)
                await asyncio.to_thread(registry.sweep)  # may fsync the store

        task = asyncio.create_task(sweeper())
        try:
            yield
        finally:
            task.cancel()

    docs = dict(docs_url="/docs", redoc_url="/redoc", openapi_url="/openapi.json")
    app = FastAPI(
        title="ac2_jax OpenAI-compatible endpoint",
        lifespan=lifespan,
        **(docs if expose_docs else {k: None for k in docs}),
    )
    app.state.registry = registry
    app.state.sampler = sampler
    app.state.tokenizer = tokenizer
    app.state.model_name = model_name
    app.state.learner_step = None  # set by POST /v1/admin/load_weights
    load_lock = asyncio.Lock()  # loads in order: learner_step never runs ahead of the weights

    async def end_as_infra_error(request: Request, exc: Exception) -> None:
        """A crash while serving a rollout's request (sampler, server) is our fault:
        the rollout ends as infra_error, so it is never trained."""
        rollout = getattr(request.state, "rollout", None)
        if rollout is None or not rollout.running:
            return
        registry.count(rollout, "server_errors")
        try:
            await asyncio.to_thread(
                registry.finish,
                rollout,
                status="infra_error",
                artifacts={"error": f"{type(exc).__name__}: {exc}"},
            )
        except Exception:  # noqa: BLE001 - e.g. it ended meanwhile; the 500 goes out anyway
            logging.exception("could not end rollout %s as infra_error", rollout.rollout_id)

    install_error_handlers(app, on_crash=end_as_infra_error)

    async def authenticate(request: Request) -> _Principal:
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else ""
        key = key or request.headers.get("x-api-key", "").strip()
        key = key or request.headers.get("x-goog-api-key", "").strip()  # the Gemini API's
        key = key or request.query_params.get("key", "").strip()
        if not key:
            raise APIError(
                401,
                "Missing API key: send 'Authorization: Bearer <key>', 'x-api-key: <key>' or "
                "(Gemini API) 'x-goog-api-key: <key>' / '?key=<key>'",
                code="missing_api_key",
            )
        if keys_equal(key, admin_key):
            return _Principal(None)
        rollout = await asyncio.to_thread(registry.by_key, key)  # its sweep may fsync
        if rollout is None:
            raise APIError(401, "Invalid API key", code="invalid_api_key")
        request.state.rollout = rollout  # for end_as_infra_error
        return _Principal(rollout)

    async def require_admin(request: Request, action: str) -> None:
        if not (await authenticate(request)).is_admin:
            raise APIError(403, f"Only the admin key can {action}", code="admin_only")

    async def owned_rollout(principal: _Principal, rollout_id: str) -> Rollout:
        # Another rollout's id gets the registry's own 404, whether it exists or not.
        if principal.rollout is not None and principal.rollout.rollout_id != rollout_id:
            raise RolloutRegistry.not_found(rollout_id)
        return await asyncio.to_thread(registry.get, rollout_id)

    def view(principal: _Principal, data: dict[str, Any]) -> dict[str, Any]:
        return data if principal.is_admin else rollout_key_view(data)

    async def read_json(request: Request) -> Any:
        return await req_lib.read_json(request, max_body_bytes, max_json_depth)

    ctx = install_generation_routes(
        app,
        sampler=sampler,
        tokenizer=tokenizer,
        registry=registry,
        model_name=model_name,
        default_max_tokens=default_max_tokens,
        authenticate=authenticate,
        read_json=read_json,
    )
    install_messages_routes(app, ctx, authenticate=authenticate, read_json=read_json)
    install_responses_routes(
        app, ctx, authenticate=authenticate, read_json=read_json, builtin_tool_policy=builtin_tools
    )
    install_gemini_routes(app, ctx, authenticate=authenticate, read_json=read_json)

    @app.get("/v1/models")
    async def models(request: Request):
        principal = await authenticate(request)
        entry = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "ac2_jax",
            "max_model_len": sampler.max_context,
            "policy_version": sampler.policy_version,
        }
        stats = sampler_stats(sampler)
        if principal.is_admin:
            entry["learner_step"] = app.state.learner_step
        if principal.is_admin and stats is not None:  # operators watch these
            entry["sampler_stats"] = stats
        adapters = [  # LoRA adapters on the same base, by "<model>@<adapter>"
            {**entry, "id": f"{model_name}@{a}", "parent": model_name, "adapter": a}
            for a in served_adapters(sampler)
        ]
        # `models`: the same list as the Gemini API gives it (google-genai 3.x's default
        # api_version is v1, so its models.list() reads this route).
        return {"object": "list", "data": [entry, *adapters], "models": gemini_models(ctx)}

    @app.post("/v1/admin/load_weights")
    async def load_weights(request: Request):
        await require_admin(request, "load weights")
        args = parse_load_weights(await read_json(request))
        async with load_lock:
            try:  # load_published checks shapes first and swaps only once all is read
                version = await asyncio.to_thread(sampler.load_weights, args["step"])
            except FileNotFoundError as e:
                raise APIError(
                    404,
                    f"Step {args['step']} is not published: {e}",
                    param="step",
                    code="step_not_found",
                ) from None
            except ValueError as e:
                raise APIError(
                    409,
                    f"The sampler cannot load step {args['step']} (start the "
                    f"endpoint with --publish_dir, and publish weights of the served "
                    f"architecture): {e}",
                    param="step",
                    code="weights_not_loaded",
                ) from None
            except SamplerError as e:
                raise APIError(
                    503,
                    f"No sampler backend loaded step {args['step']}: {e}",
                    code="sampler_unavailable",
                ) from None
            if args["learner_step"] is not None:
                app.state.learner_step = args["learner_step"]
        return {
            "object": "weights",
            "policy_version": int(version),
            "learner_step": app.state.learner_step,
        }

    @app.post("/v1/rollouts")
    async def create_rollout(request: Request):
        await require_admin(request, "create rollouts")
        args = parse_create(await read_json(request))
        rollout = await asyncio.to_thread(lambda: registry.create(**args))
        root = str(request.base_url).rstrip("/")
        return {
            "rollout_id": rollout.rollout_id,
            # One base URL per request API, each as its official client takes it: the
            # openai client appends /chat/completions (or /responses) to ".../v1", the
            # anthropic client /v1/messages to the server root, the google-genai client
            # (and Gemini CLI's GOOGLE_GEMINI_BASE_URL) /v1beta/models/... to the root.
            "base_url": root + "/v1",
            "anthropic_base_url": root,
            "gemini_base_url": root,
            "api_key": rollout.api_key,
            "model": model_name,
            "task_id": rollout.trace.task_id,
            "attempt_id": rollout.trace.attempt_id,
            "group_id": rollout.trace.group_id,
        }

    @app.get("/v1/rollouts/{rollout_id}")
    async def rollout_status(rollout_id: str, request: Request):
        principal = await authenticate(request)
        if principal.is_admin:
            evicted = await asyncio.to_thread(registry.evicted_summary, rollout_id)
            if evicted is not None:
                return evicted
        rollout = await owned_rollout(principal, rollout_id)
        return view(principal, await asyncio.to_thread(registry.summary, rollout))

    @app.post("/v1/rollouts/{rollout_id}/finish")
    async def finish_rollout(rollout_id: str, request: Request):
        principal = await authenticate(request)
        rollout = await owned_rollout(principal, rollout_id)
        args = parse_finish(await read_json(request))
        if not principal.is_admin:
            check_rollout_key_finish(args)
        try:
            await asyncio.to_thread(lambda: registry.finish(rollout, **args))
        except APIError:
            raise
        except Exception:  # noqa: BLE001 - e.g. the trace store's disk
            logging.exception("finishing rollout %s failed", rollout_id)
            raise APIError(
                500,
                f"Could not store the trace of {rollout_id}; nothing changed",
                code="trace_store_error",
            ) from None
        return view(principal, await asyncio.to_thread(registry.summary, rollout))

    @app.get("/v1/rollouts/{rollout_id}/trace")
    async def rollout_trace(rollout_id: str, request: Request):
        principal = await authenticate(request)
        if principal.is_admin:
            stored = await asyncio.to_thread(registry.stored_trace, rollout_id)
            if stored is not None:  # evicted from memory: read back from the store
                return stored
        rollout = await owned_rollout(principal, rollout_id)
        return view(principal, await asyncio.to_thread(registry.trace_dict, rollout))

    return app
