"""The rollout lifecycle API ("lifecycle" in `apis.REQUEST_APIS`).

  GET  /v1/models                   the served model (and its LoRA adapters); the admin also
                                    gets `learner_step` and `sampler_stats`
  POST /v1/admin/load_weights       (admin) {step, learner_step?}
  POST /v1/rollouts                 (admin) create a rollout and its key
  GET  /v1/rollouts/{id}            status
  POST /v1/rollouts/{id}/finish     end it (the admin grades it)
  GET  /v1/rollouts/{id}/trace      the trace JSON

What each route takes and answers is in `app`'s module docstring; the bodies
are checked by `rollout_requests`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import Request

from ac2_jax.sampling import Sampler, SamplerError
from ac2_jax.serving.apis import APIMount, Principal
from ac2_jax.serving.apis.gemini.routes import gemini_models
from ac2_jax.serving.core.errors import APIError
from ac2_jax.serving.core.generation import served_adapters
from ac2_jax.serving.lifecycle.rollout_requests import (
    check_rollout_key_finish,
    parse_create,
    parse_finish,
    parse_load_weights,
    rollout_key_view,
)
from ac2_jax.serving.lifecycle.rollouts import Rollout, RolloutRegistry

__all__ = ["install_lifecycle_routes", "sampler_stats"]


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


def install_lifecycle_routes(m: APIMount) -> None:
    """Adds the lifecycle routes (see the module docstring) to `m.app`."""
    app, ctx = m.app, m.ctx
    registry, sampler, model_name = ctx.registry, ctx.sampler, ctx.model_name
    authenticate, read_json = m.authenticate, m.read_json
    app.state.learner_step = None  # set by POST /v1/admin/load_weights
    load_lock = asyncio.Lock()  # loads in order: learner_step never runs ahead of the weights

    async def owned_rollout(principal: Principal, rollout_id: str) -> Rollout:
        # Another rollout's id gets the registry's own 404, whether it exists or not.
        if principal.rollout is not None and principal.rollout.rollout_id != rollout_id:
            raise RolloutRegistry.not_found(rollout_id)
        return await asyncio.to_thread(registry.get, rollout_id)

    def view(principal: Principal, data: dict[str, Any]) -> dict[str, Any]:
        return data if principal.is_admin else rollout_key_view(data)

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
        served = getattr(sampler, "served_weights", None)
        if principal.is_admin and callable(served):  # the weights alarm (training.rl.alarms)
            entry["served_weights"] = served()
        adapters = [  # LoRA adapters on the same base, by "<model>@<adapter>"
            {**entry, "id": f"{model_name}@{a}", "parent": model_name, "adapter": a}
            for a in served_adapters(sampler)
        ]
        out: dict[str, Any] = {"object": "list", "data": [entry, *adapters]}
        if "gemini" in m.apis:
            # `models`: the same list as the Gemini API gives it (google-genai 3.x's
            # default api_version is v1, so its models.list() reads this route).
            out["models"] = gemini_models(ctx)
        return out

    @app.post("/v1/admin/load_weights")
    async def load_weights(request: Request):
        await m.require_admin(request, "load weights")
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
        await m.require_admin(request, "create rollouts")
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
