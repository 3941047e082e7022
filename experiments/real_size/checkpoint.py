"""Real-size models without a download: random HF checkpoints from transformers'
own Qwen3Config, loaded as a Decoder with a preset's runtime choices.

    cfg = experiments.real_size.qwen3.get_config()            # Qwen3-0.6B shape
    path = write_random_checkpoint(cfg.shape, "/tmp/qwen3-0.6b-random")
    model, config = load_preset(cfg, path)

Needs torch and transformers (the `dev` extra).
"""

from __future__ import annotations

import os

import jax.numpy as jnp

from ac2_jax.models import load_hf_checkpoint
from ac2_jax.models.config import RUNTIME_FIELDS


def qwen3_config(shape):
    """`transformers.Qwen3Config(**shape)` (shape: a dict or ConfigDict of its kwargs)."""
    import transformers
    shape = shape.to_dict() if hasattr(shape, "to_dict") else dict(shape)
    return transformers.Qwen3Config(**shape)


def write_random_checkpoint(shape, path: str, seed: int = 0, dtype: str = "float32") -> str:
    """Builds `Qwen3ForCausalLM` with random weights (transformers' init, `seed`) and
    saves config.json + safetensors to `path` (created). Returns `path`.

    Peak memory is about the model's size in `dtype` (0.6B: 2.4 GB in fp32).
    """
    import torch
    import transformers
    config = qwen3_config(shape)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path


def preset_runtime(cfg) -> dict:
    """`load_hf_checkpoint` / `load_hf_config` keyword arguments (dtype, param_dtype and
    the runtime fields) of the preset's `model` section."""
    model_cfg = cfg.model.to_dict() if hasattr(cfg.model, "to_dict") else dict(cfg.model)
    unknown = sorted(set(model_cfg) - set(RUNTIME_FIELDS) - {"dtype", "param_dtype"})
    if unknown:
        raise ValueError(f"load_preset: model section keys {unknown} are not dtypes or "
                         f"runtime fields {RUNTIME_FIELDS}; the shape comes from config.json")
    runtime = {k: v for k, v in model_cfg.items() if k in RUNTIME_FIELDS}
    param_dtype = model_cfg.get("param_dtype")
    return dict(dtype=jnp.dtype(model_cfg.get("dtype", "float32")),
                param_dtype=None if param_dtype is None else jnp.dtype(param_dtype), **runtime)


def load_preset(cfg, path: str):
    """(Decoder, DecoderConfig) from the HF checkpoint at `path` with the dtypes and
    runtime fields of the preset's `model` section."""
    return load_hf_checkpoint(path, **preset_runtime(cfg))
