"""ac2_jax: train LLM agents on whole task attempts (traces), in JAX/Flax."""
from setuptools import find_packages, setup

setup(
    name="ac2_jax",
    version="0.1.0",
    description="Task-level RL and self-distillation for LLM agents in JAX/Flax.",
    packages=find_packages(include=["ac2_jax", "ac2_jax.*"]),
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.4.35",
        "flax>=0.10",
        "optax>=0.2.3",
        "orbax-checkpoint>=0.9",
        "numpy>=1.26",
        "absl-py>=2.0",
        "ml-collections>=0.1.1",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "httpx>=0.27",
        "openai>=1.30",
        "tensorboardX>=2.6",
        "rich>=13",
        "jinja2>=3.1",
        "matplotlib>=3.8",
    ],
    extras_require={
        # Parity tests and peer benchmarks only; never imported by the core.
        "dev": ["pytest>=8", "torch", "transformers>=4.51"],
        # GPU serving at scale (CUDA machines only).
        "sglang": ["sglang[all]"],
    },
)
