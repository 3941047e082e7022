"""Serving: the OpenAI-compatible endpoint and the rollout lifecycle API.

`build_app(sampler, tokenizer, admin_key=...)` makes the FastAPI app (see
`app` for the routes; it mounts the request APIs registered in `REQUEST_APIS`,
`apis`; `generation` for the sampling routes, `streaming` for
SSE, `requests` and `rollout_requests` for body validation);
`serve_in_thread(app)` runs it on 127.0.0.1 for tests and notebooks;
`python -m ac2_jax.serving` runs it as a process.

Needs the serve extra (fastapi, uvicorn): without it, importing any of
`ac2_jax.serving` raises `ac2_jax.extras.MissingExtraError`, one line naming
`pip install 'ac2_jax[serve]'`.
"""

from ac2_jax.extras import require

# Before any module of the package imports them.
require("fastapi", "serve", what="ac2_jax.serving")
require("uvicorn", "serve", what="ac2_jax.serving")

from ac2_jax.serving.apis import REQUEST_APIS, APIMount  # noqa: E402
from ac2_jax.serving.app import build_app  # noqa: E402
from ac2_jax.serving.errors import APIError  # noqa: E402
from ac2_jax.serving.rollouts import Rollout, RolloutRegistry  # noqa: E402
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
