"""Real-size model shapes by name: the published `config.json` fields of each model.

    hf = shape_config("qwen3-8b")          # {"model_type": "qwen3", "hidden_size": 4096, ...}
    config = config_from_hf(hf, dtype=jnp.bfloat16, param_dtype=jnp.float32)

Each entry is (transformers config class, keyword arguments): the numbers of the
model's own config.json on the Hugging Face hub, written out here (nothing is
downloaded). `shape_config` gives the config.json dict the families read
(`models.family.config_from_hf`); `shape_kwargs` the class name and kwargs, so a
caller with transformers installed builds the class itself
(`getattr(transformers, cls)(**kwargs)`, e.g. to write a random checkpoint);
`python -m ac2_jax.aot` compiles them ahead of time.
Weights never exist here: these are shapes for abstract models and random
checkpoints.
"""

from __future__ import annotations

import copy
from typing import Any

from ac2_jax.registry import Registry

__all__ = ["SHAPES", "shape_config", "shape_kwargs"]

# name -> (transformers config class, its kwargs as the model's config.json has them)
SHAPES: Registry[tuple[str, dict[str, Any]]] = Registry("model shape")

_S, _F = "sliding_attention", "full_attention"
_ROPE_1M = {"rope_type": "default", "rope_theta": 1_000_000.0}
# Qwen/Qwen3-0.6B config.json (1.7B, 4B and 8B differ in width, depth and tying).
_QWEN3_0_6B = dict(
    vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40_960,
    rms_norm_eps=1e-6, rope_parameters=_ROPE_1M, tie_word_embeddings=True,
)  # fmt: skip
_LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=8192)  # fmt: skip

_BUILTIN: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": ("Qwen3Config", _QWEN3_0_6B),
    # Qwen/Qwen3-1.7B
    "qwen3-1.7b": ("Qwen3Config", dict(_QWEN3_0_6B, hidden_size=2048, intermediate_size=6144)),
    # Qwen/Qwen3-4B
    "qwen3-4b": ("Qwen3Config", dict(
        _QWEN3_0_6B, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32)),
    # Qwen/Qwen3-8B
    "qwen3-8b": ("Qwen3Config", dict(
        _QWEN3_0_6B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, tie_word_embeddings=False)),
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        vocab_size=151_936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=40_960, rms_norm_eps=1e-6,
        rope_parameters=_ROPE_1M, tie_word_embeddings=False)),
    # google/gemma-3-1b-pt (sliding_window_pattern 6: 5 sliding layers, then 1 full)
    "gemma3-1b": ("Gemma3TextConfig", dict(
        vocab_size=262_144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        query_pre_attn_scalar=256, max_position_embeddings=32_768, rms_norm_eps=1e-6,
        layer_types=[_F if (i + 1) % 6 == 0 else _S for i in range(26)],
        rope_parameters={_F: _ROPE_1M, _S: {"rope_type": "default", "rope_theta": 10_000.0}},
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)),
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": ("LlamaConfig", dict(
        vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131_072, rms_norm_eps=1e-5,
        rope_parameters=dict(_LLAMA3_ROPE, factor=32.0), tie_word_embeddings=True)),
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": ("LlamaConfig", dict(
        vocab_size=128_256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131_072, rms_norm_eps=1e-5, rope_parameters=_LLAMA3_ROPE,
        tie_word_embeddings=False)),
}  # fmt: skip
_MODEL_TYPE = {
    "Qwen3Config": "qwen3",
    "Qwen3MoeConfig": "qwen3_moe",
    "Gemma3TextConfig": "gemma3_text",
    "LlamaConfig": "llama",
}
for _name, _entry in _BUILTIN.items():
    SHAPES.register(_name)(_entry)


def shape_kwargs(name: str) -> tuple[str, dict[str, Any]]:
    """(transformers config class name, its kwargs) of shape `name` (a copy; a
    ValueError with the nearest names for an unknown one)."""
    cls, kwargs = SHAPES.get(name)
    return cls, copy.deepcopy(kwargs)


def shape_config(name: str) -> dict[str, Any]:
    """The config.json dict of shape `name`: its kwargs plus `model_type`, the form
    `models.family.config_from_hf` reads."""
    cls, kwargs = shape_kwargs(name)
    if cls not in _MODEL_TYPE:
        raise ValueError(f"shape {name!r}: no model_type known for {cls} ({sorted(_MODEL_TYPE)})")
    return {"model_type": _MODEL_TYPE[cls], **kwargs}
