"""Request APIs: the route sets `build_app` mounts, by name.

This package holds the registry and the APIs that translate into the serving core
(`ac2_jax.serving.core`), one subpackage each; `_builtins` registers the built-in ones.

Built in (`build_app` mounts every registered API unless `apis=` names some):

- "openai": POST /v1/chat/completions, /v1/completions (`core.generation`: the
  serving core's own request shape).
- "anthropic": POST /v1/messages, /v1/messages/count_tokens (`apis.messages`).
- "responses": POST /v1/responses, GET /v1/responses/{id} (`apis.responses`).
- "gemini": /v1beta/models/{model}:generateContent ... (`apis.gemini`).
- "lifecycle": GET /v1/models, POST /v1/admin/load_weights, /v1/rollouts ...
  (`lifecycle.routes`: the rollout keys every other API's requests are recorded under).

A new API is one function registered from its own module (or a test), nothing
shared changed; it serves through the same `ServeContext` (sampler, tokenizer,
rollouts) and authentication as the built-in ones:

    @REQUEST_APIS.register("mine")
    def mount_mine(m: APIMount) -> None:
        @m.app.post("/mine/generate")
        async def generate(request: Request):
            principal = await m.authenticate(request)
            body = await m.read_json(request)
            ...

Errors: raise `APIError` (answered in OpenAI's shape) or install the API's own
shape for its paths, as `gemini` and `messages` do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request

from ac2_jax.registry import Registry
from ac2_jax.serving.core.errors import APIError
from ac2_jax.serving.core.sample_run import ServeContext
from ac2_jax.serving.lifecycle.rollouts import Rollout

__all__ = ["REQUEST_APIS", "APIMount", "Principal"]


class Principal:
    """Who is calling: the admin (rollout None) or one running rollout."""

    def __init__(self, rollout: Rollout | None):
        self.rollout = rollout

    @property
    def is_admin(self) -> bool:
        return self.rollout is None


@dataclasses.dataclass(frozen=True)
class APIMount:
    """What a request API's mount function gets.

    app: the FastAPI app to add routes to. ctx: the serving context (sampler,
    tokenizer, rollout registry, model name, default max_tokens).
    authenticate(request) -> Principal: the caller's key (401 if none or unknown).
    read_json(request) -> the body, strict JSON within the size and depth limits.
    apis: the names of every API this app mounts. builtin_tools: build_app's
    policy for built-in tools the server cannot run ("omit" or "refuse").
    """

    app: FastAPI
    ctx: ServeContext
    authenticate: Callable[[Request], Awaitable[Principal]]
    read_json: Callable[[Request], Awaitable[Any]]
    apis: tuple[str, ...]
    builtin_tools: str = "omit"

    async def require_admin(self, request: Request, action: str) -> Principal:
        """The admin's principal; a rollout key gets a 403 naming `action`."""
        principal = await self.authenticate(request)
        if not principal.is_admin:
            raise APIError(403, f"Only the admin key can {action}", code="admin_only")
        return principal


# Request APIs by name: fn(APIMount) -> None adds the API's routes.
REQUEST_APIS: Registry[Callable[[APIMount], None]] = Registry(
    "request API", builtins="ac2_jax.serving.apis._builtins"
)
