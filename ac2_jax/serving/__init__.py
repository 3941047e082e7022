"""Serving: the OpenAI-compatible endpoint and the rollout lifecycle API.

`build_app(sampler, tokenizer, admin_key=...)` makes the FastAPI app (see
`app` for the routes; it mounts the request APIs registered in `REQUEST_APIS`);
`serve_in_thread(app)` runs it on 127.0.0.1 for tests and notebooks;
`python -m ac2_jax.serving` runs it as a process (`server`), and
`python -m ac2_jax.serving.backend` a JaxSampler behind SGLang's native API.

Layout: `core/` (the one serving core every request API goes through: body validation,
prompt splicing, grammars, sampling, streaming, recording; OpenAI Chat Completions is
its own request shape), `apis/` (the request API registry and the APIs that translate
into the core: `messages` (Anthropic), `responses` (OpenAI Responses), `gemini`) and
`lifecycle/` (rollouts: one task attempt = one key = one trace, and their routes). The
modules' old flat paths (`ac2_jax.serving.generation`, ...) are deprecation aliases for
one release (`ac2_jax._deprecation.MOVED_MODULES`).

Needs the serve extra (fastapi, uvicorn): without it, importing any of
`ac2_jax.serving` raises `ac2_jax.extras.MissingExtraError`, one line naming
`pip install 'ac2_jax[serve]'`.
"""

from ac2_jax._deprecation import install_moved_modules
from ac2_jax.extras import require

# Before any module of the package imports them.
require("fastapi", "serve", what="ac2_jax.serving")
require("uvicorn", "serve", what="ac2_jax.serving")

from ac2_jax.serving.apis import REQUEST_APIS, APIMount  # noqa: E402
from ac2_jax.serving.app import build_app  # noqa: E402
from ac2_jax.serving.core.errors import APIError  # noqa: E402
from ac2_jax.serving.lifecycle.rollouts import Rollout, RolloutRegistry  # noqa: E402
from ac2_jax.serving.server import load_policy, serve_in_thread  # noqa: E402

__all__ = [
    "REQUEST_APIS",
    "APIMount",
    "APIError",
    "Rollout",
    "RolloutRegistry",
    "build_app",
    "load_policy",
    "serve_in_thread",
]

install_moved_modules(__name__)
