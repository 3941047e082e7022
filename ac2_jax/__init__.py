"""ac2_jax: train LLM agents on whole task attempts (traces) in JAX/Flax.

Layers, lowest first (a module imports only from layers below its own):
trace, segments, losses, text, models, sampling, serving, envs, orchestration,
training, evals, viz, recipes, testing; `ac2_jax.config` turns config files into
their dataclasses. Design: docs/design.md.

Subpackages load on first use (`ac2_jax.losses` after `import ac2_jax`), so
importing the package pulls in nothing heavy.
"""

import importlib

__version__ = "0.1.0"

_SUBPACKAGES = (
    "trace",
    "segments",
    "losses",
    "text",
    "models",
    "sampling",
    "serving",
    "envs",
    "orchestration",
    "training",
    "evals",
    "viz",
    "config",
    "seeds",
    "testing",
)


def __getattr__(name):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"ac2_jax.{name}")
    raise AttributeError(f"module 'ac2_jax' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_SUBPACKAGES})
