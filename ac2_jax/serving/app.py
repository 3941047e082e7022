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

from ac2_jax.sampling import Sampler
from ac2_jax.serving.apis import REQUEST_APIS, APIMount, Principal
from ac2_jax.serving.core import requests as req_lib
from ac2_jax.serving.core.errors import APIError, install_error_handlers
from ac2_jax.serving.core.sample_run import ServeContext
from ac2_jax.serving.lifecycle.rollout_requests import keys_equal
from ac2_jax.serving.lifecycle.rollouts import RolloutRegistry
from ac2_jax.serving.lifecycle.routes import sampler_stats
from ac2_jax.text.tokenizer import Tokenizer
from ac2_jax.trace import TraceStore

__all__ = ["BUILTIN_APIS", "build_app", "mounted_apis", "sampler_stats"]

# The built-in request APIs in the order they are mounted (`apis.REQUEST_APIS`).
BUILTIN_APIS = ("openai", "anthropic", "responses", "gemini", "lifecycle")


def mounted_apis(apis) -> tuple[str, ...]:
    """The request APIs `build_app(apis=...)` mounts, in order: None is every
    registered one (the built-in ones first); a string is names, comma-separated
    ("openai,lifecycle", as --apis); an unknown name is a ValueError naming the
    registered ones (did-you-mean)."""
    if isinstance(apis, str):
        apis = [name.strip() for name in apis.split(",") if name.strip()]
    if apis is None:
        names = REQUEST_APIS.names()
        return (
            *(n for n in BUILTIN_APIS if n in names),
            *(n for n in names if n not in BUILTIN_APIS),
        )
    out = tuple(apis)
    if not out:
        raise ValueError("build_app: apis names no request API (None mounts every registered one)")
    for name in out:
        REQUEST_APIS.get(name)
    if len(set(out)) != len(out):
        raise ValueError(f"build_app: apis lists a request API twice: {list(out)}")
    return out


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
    apis=None,
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
    apis: the request APIs to mount, by name (`apis.REQUEST_APIS`; None: every
    registered one, the built-in ones first: `BUILTIN_APIS`).
    """
    if not admin_key:
        raise ValueError("build_app: admin_key must be a non-empty string")
    names = mounted_apis(apis)
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
    app.state.apis = names

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

    async def authenticate(request: Request) -> Principal:
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
            return Principal(None)
        rollout = await asyncio.to_thread(registry.by_key, key)  # its sweep may fsync
        if rollout is None:
            raise APIError(401, "Invalid API key", code="invalid_api_key")
        request.state.rollout = rollout  # for end_as_infra_error
        return Principal(rollout)

    async def read_json(request: Request) -> Any:
        return await req_lib.read_json(request, max_body_bytes, max_json_depth)

    ctx = ServeContext(sampler, tokenizer, registry, model_name, default_max_tokens)
    mount = APIMount(app, ctx, authenticate, read_json, names, builtin_tools)
    for name in names:
        REQUEST_APIS.get(name)(mount)
    return app
