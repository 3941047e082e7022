"""The rollout lifecycle: one task attempt = one API key = one recorded trace.

`rollouts` (`Rollout`, `RolloutRegistry`: the keys every request API records its
completions under), `rollout_requests` (the create / finish / load-weights bodies, what a
rollout key may do and see) and `routes` (the "lifecycle" request API: /v1/models,
/v1/admin/load_weights, /v1/rollouts ...).

This package took the path of the former module `ac2_jax.serving.lifecycle` (now
`routes`): its names still resolve here, warning, for one release (`DEPRECATED`).
"""

from ac2_jax._deprecation import deprecated_getattr

DEPRECATED = {
    "install_lifecycle_routes": "ac2_jax.serving.lifecycle.routes:install_lifecycle_routes",
    "sampler_stats": "ac2_jax.serving.lifecycle.routes:sampler_stats",
}
__getattr__ = deprecated_getattr(__name__, DEPRECATED)
