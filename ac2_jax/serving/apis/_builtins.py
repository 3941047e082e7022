"""The built-in request APIs, registered in `REQUEST_APIS` on its first lookup."""

from __future__ import annotations

from ac2_jax.serving.apis import REQUEST_APIS, APIMount
from ac2_jax.serving.apis.gemini.routes import install_gemini_routes
from ac2_jax.serving.apis.messages.routes import install_messages_routes
from ac2_jax.serving.apis.responses.routes import install_responses_routes
from ac2_jax.serving.core.generation import install_generation_routes
from ac2_jax.serving.lifecycle.routes import install_lifecycle_routes

__all__ = ["mount_anthropic", "mount_gemini", "mount_openai", "mount_responses"]


@REQUEST_APIS.register("openai")
def mount_openai(m: APIMount) -> None:
    """OpenAI's POST /v1/chat/completions and /v1/completions (`generation`)."""
    install_generation_routes(m.app, m.ctx, authenticate=m.authenticate, read_json=m.read_json)


@REQUEST_APIS.register("anthropic")
def mount_anthropic(m: APIMount) -> None:
    """Anthropic's POST /v1/messages and /v1/messages/count_tokens (`messages`)."""
    install_messages_routes(m.app, m.ctx, authenticate=m.authenticate, read_json=m.read_json)


@REQUEST_APIS.register("responses")
def mount_responses(m: APIMount) -> None:
    """OpenAI's Responses API, POST /v1/responses and GET /v1/responses/{id}
    (`responses`; built-in tools as `m.builtin_tools` says)."""
    install_responses_routes(
        m.app, m.ctx, authenticate=m.authenticate, read_json=m.read_json,
        builtin_tool_policy=m.builtin_tools,
    )  # fmt: skip


@REQUEST_APIS.register("gemini")
def mount_gemini(m: APIMount) -> None:
    """The Gemini API under /v1beta/models (`gemini`)."""
    install_gemini_routes(m.app, m.ctx, authenticate=m.authenticate, read_json=m.read_json)


REQUEST_APIS.register("lifecycle")(install_lifecycle_routes)
