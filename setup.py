"""ac2_jax: train LLM agents on whole task attempts (traces), in JAX/Flax.

Core: what `ac2_jax.{trace,segments,losses,models,sampling,envs,orchestration,
training,evals}` import (tests/test_layering.py checks it). Extras: serve (the
FastAPI endpoint), viz (matplotlib curves), dev (tests and parity references).
Lower bounds are the oldest releases with the APIs the code calls; the test
suite runs on the versions recorded in the dated notes (docs/notes/).
"""
from setuptools import find_packages, setup

REQUIRES = [
    "jax>=0.7.1",              # jax.set_mesh, jax.sharding.get_abstract_mesh; flax 0.12's floor
    "flax>=0.12",              # nnx.List, nnx.to_flat_state / from_flat_state, nnx.Pytree modules
    "optax>=0.2.3",            # optax.adamw(mask=), chain, clip_by_global_norm
    "orbax-checkpoint>=0.9",   # CheckpointManager with args.Composite / StandardSave / JsonSave
    "numpy>=1.26",
    "scipy>=1.15",             # evals: scipy.stats quantiles, bootstrap(rng=)
    "absl-py>=2.0",            # app/flags entry points
    "ml-collections>=0.1.1",   # config files (experiments, config_flags)
    "safetensors>=0.4",        # HF checkpoint I/O
    "tokenizers>=0.19",
    "jinja2>=3.1",             # chat templates
    "llguidance>=1.9",         # grammar-constrained decoding (sampling.constraints)
    "httpx>=0.27",             # LifecycleClient, SGLangSampler
    "openai>=1.30",            # orchestrators reach the model through an OpenAI client
    "rich>=13",                # training progress (imported when a trainer runs)
]

EXTRAS = {
    # The OpenAI-compatible endpoint + rollout lifecycle (ac2_jax.serving).
    "serve": ["fastapi>=0.110", "uvicorn>=0.29", "httpx>=0.27", "openai>=1.30"],
    # Training curves (ac2_jax.viz.curves).
    "viz": ["matplotlib>=3.8"],
    # Weights & Biases metrics (MetricsLogger(wandb=...)).
    "wandb": ["wandb>=0.16"],
    # GPU serving at scale (CUDA machines only).
    "sglang": ["sglang[all]"],
    # Environments of other libraries, trained unchanged (ac2_jax.envs.adapters).
    "reasoning-gym": ["reasoning-gym>=0.1.25"],
    # verifiers 0.4 pins openai<3 (and reshapes the v0 API the adapter drives): 0.3.x.
    "verifiers": ["verifiers>=0.3.1,<0.4"],
    "textarena": ["textarena>=0.7.4"],
    "gymnasium": ["gymnasium>=1.0"],
    # OpenEnv servers (the adapter speaks its /ws session protocol). It brings ~45 packages
    # (gradio, fastmcp, pillow, ...): 12 s more of `pip install` from a warm cache.
    "openenv": ["openenv>=0.10"],
    # Compiling for TPU topologies ahead of time on any host (`python -m ac2_jax.aot`):
    # libtpu through jax's own extra, pinned to the jax the suite runs (libtpu is built
    # for one jaxlib). In "dev": the suite compiles a toy step for v5e:2x2 (213 MB wheel).
    "tpu-aot": ["jax[tpu]==0.10.2"],
}
# Tests, parity references (torch CPU, transformers: never imported by ac2_jax)
# and everything the test suite exercises.
# ruff and mypy are pinned: "zero findings" in scripts/test.sh is a statement about
# one version of each (a newer release adds rules and inferences).
# The docs site (tests/test_docs.py builds it with --strict) and the notebooks (run under a
# real Jupyter kernel by tests/notebooks/) are tested too.
DOCS = ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"]
NOTEBOOKS = ["nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29"]
EXTRAS["dev"] = sorted({"pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6", "torch",
                        "transformers>=4.51", "peft>=0.17",
                        "trl>=1.16",  # the RL objectives' parity test (GRPOTrainer._compute_loss)
                        "anthropic", "google-genai>=1.30",
                        "tensorboardX>=2.6",  # the reference of training.core._tfevents' files
                        "ruff==0.17.5", "mypy==2.4.1", *EXTRAS["serve"], *EXTRAS["viz"],
                        *EXTRAS["reasoning-gym"], *EXTRAS["verifiers"], *EXTRAS["textarena"],
                        *EXTRAS["gymnasium"], *EXTRAS["openenv"], *EXTRAS["tpu-aot"],
                        *DOCS, *NOTEBOOKS})

setup(
    name="ac2_jax",
    version="0.1.0",
    description="Task-level RL and self-distillation for LLM agents in JAX/Flax.",
    packages=find_packages(include=["ac2_jax", "ac2_jax.*"]),
    # Explicit root: `pip install -e .` then uses a plain .pth file (no meta-path
    # finder, no setuptools "Editable installation" warning on every install).
    package_dir={"": "."},
    python_requires=">=3.11",  # flax >= 0.12 needs 3.11
    install_requires=REQUIRES,
    extras_require=EXTRAS,
)
