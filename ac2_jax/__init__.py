"""ac2_jax: train LLM agents on whole task attempts (traces) in JAX/Flax.

Layers, lowest first (a module imports only from layers below its own):
trace, segments, losses, models, sampling, serving, envs, orchestration,
training, evals, viz.
"""

__version__ = "0.1.0"
