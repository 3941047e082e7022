"""Gemma3Config: the shape of a Gemma 3 text decoder (HF `Gemma3TextConfig`,
model_type "gemma3_text"), and its `config.json` both ways.

The model is `models.gemma3.Gemma3` (which registers the family). Read: the
form transformers 5 writes (`rope_parameters` per layer type, `layer_types`)
and the form the Gemma 3 checkpoints shipped with (`rope_theta`,
`rope_local_base_freq`, `rope_scaling`, `sliding_window_pattern`); written:
transformers 5's. What Gemma 3 never sets (logit / attention soft-capping,
bidirectional attention, attention biases, another activation, RoPE types
other than default / linear) is refused by name.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from ac2_jax.models.config import RUNTIME_FIELDS, ModelConfig, dtype_name

__all__ = [
    "FULL",
    "RUNTIME_FIELDS",
    "SLIDING",
    "Gemma3Config",
    "default_layer_types",
    "gemma3_config_from_hf",
    "gemma3_hf_config",
    "rope_inv_freqs",
]

SLIDING, FULL = "sliding_attention", "full_attention"
_HF_ZERO = {  # config.json fields Gemma 3 sets this way, and we support only this way
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
    "attention_bias": False,
}


def default_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    """HF's default: every `pattern`-th layer full, the others sliding."""
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


@dataclasses.dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    """Hyper-parameters of a Gemma 3 text decoder (HF `Gemma3TextConfig`'s names in brackets):
    `ModelConfig`'s fields (some with Gemma's defaults) and its own.

    layer_types [layer_types]: one of "sliding_attention" / "full_attention"
    per layer (empty: HF's default, every 6th layer full). sliding_window
    [sliding_window]: the window of the sliding layers (None: they see the
    whole causal context). rope_theta: the full layers' RoPE base, with
    `rope_scaling` (None or {"rope_type": "linear", "factor": f});
    rope_local_theta: the sliding layers' ([rope_parameters] full_attention /
    sliding_attention). query_pre_attn_scalar: scores are scaled by its
    -1/2 power. pad / bos / eos token ids are carried for the config.json.
    `qk_norm` is always True and `attention_bias` False (Gemma 3's);
    `mlp_backward` must be "autodiff".
    """

    _: dataclasses.KW_ONLY  # every field past head_dim by keyword (ModelConfig)
    sliding_window: int | None = 4096
    tie_embeddings: bool = True
    max_position_embeddings: int = 131_072
    family: str = "gemma3_text"
    mlp_backward: str = "autodiff"
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: float = 256
    rope_local_theta: float = 10_000.0
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | tuple[int, ...] | None = 1

    ROPE_TYPES: ClassVar[tuple[str, ...]] = ("default", "linear")
    # `tiny()`: a few-thousand-parameter Gemma 3 (4 layers: sliding, full, sliding, full).
    TINY: ClassVar[dict[str, Any]] = dict(
        ModelConfig.TINY,
        num_layers=4,
        layer_types=(SLIDING, FULL, SLIDING, FULL),
        sliding_window=8,
        query_pre_attn_scalar=8,
        rope_theta=1_000_000.0,
    )

    def _normalize(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", default_layer_types(int(self.num_layers)))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    def _check(self) -> None:
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(
                f"Gemma3Config.layer_types must name {SLIDING!r} or {FULL!r} for each of the "
                f"{self.num_layers} layers, got {self.layer_types}"
            )
        if not float(self.query_pre_attn_scalar) > 0:
            raise ValueError(
                f"Gemma3Config.query_pre_attn_scalar must be > 0, got {self.query_pre_attn_scalar}"
            )
        if self.mlp_backward != "autodiff":
            raise ValueError(
                f"Gemma3Config.mlp_backward must be 'autodiff' (Gemma's GeGLU MLP has no "
                f"custom backward; 'custom' is SwiGLU's), got {self.mlp_backward!r}"
            )
        if self.qk_norm is not True or self.attention_bias is not False:
            raise ValueError(
                "Gemma3Config: Gemma 3 has qk_norm=True and attention_bias=False, got "
                f"qk_norm={self.qk_norm}, attention_bias={self.attention_bias}"
            )

    @property
    def sliding(self) -> tuple[bool, ...]:
        """Per layer: whether it is a sliding-window layer (local RoPE, windowed mask)."""
        return tuple(t == SLIDING for t in self.layer_types)

    @property
    def windowed(self) -> bool:
        """Whether any layer's mask has a window."""
        return self.sliding_window is not None and any(self.sliding)


def _rope_kind(scaling: dict | None) -> str:
    if scaling is None:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_inv_freqs(c: Gemma3Config) -> tuple[np.ndarray, np.ndarray]:
    """(local, global) inverse RoPE frequencies [head_dim // 2]: the sliding layers'
    (base rope_local_theta) and the full layers' (base rope_theta, divided by a
    linear scaling's factor)."""
    d = c.head_dim

    def inv(base: float) -> np.ndarray:
        return 1.0 / (base ** (np.arange(0, d, 2, dtype=np.float64) / d))

    glob = inv(c.rope_theta)
    if _rope_kind(c.rope_scaling) == "linear":
        assert c.rope_scaling is not None
        glob = glob / float(c.rope_scaling["factor"])
    return inv(c.rope_local_theta).astype(np.float32), glob.astype(np.float32)


def gemma3_config_from_hf(
    hf: dict[str, Any], dtype: Any = jnp.float32, param_dtype: Any = None, **runtime
) -> Gemma3Config:
    """A Gemma3Config from a `gemma3_text` config.json: transformers 5's form
    (`rope_parameters` per layer type, `layer_types`) or the form the Gemma 3
    checkpoints shipped with (`rope_theta`, `rope_local_base_freq`,
    `rope_scaling`, `sliding_window_pattern`). `runtime`: `RUNTIME_FIELDS`."""
    bad = sorted(set(runtime) - set(RUNTIME_FIELDS))
    if bad:
        raise ValueError(
            f"from_hf_config: {bad} come from config.json; only {RUNTIME_FIELDS} may be passed"
        )
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"from_hf_config: gemma3_text hidden_activation {act!r} is not supported")
    for field, want in _HF_ZERO.items():
        if hf.get(field, want) not in (want, None):
            raise ValueError(
                f"from_hf_config: gemma3_text {field}={hf[field]!r} is not supported "
                f"(only {want!r})"
            )
    n = int(hf["num_hidden_layers"])
    pattern = int(hf.get("sliding_window_pattern", 6))
    types = hf.get("layer_types") or default_layer_types(n, pattern)
    rope = hf.get("rope_parameters") or {}
    if FULL in rope or SLIDING in rope:
        glob = dict(rope.get(FULL) or {})
        local = dict(rope.get(SLIDING) or {})
    else:  # the shipped form
        glob = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e6)}
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 1e4)}
    if _rope_kind(local) != "default":
        raise ValueError(
            f"from_hf_config: gemma3_text sliding layers' rope_type {_rope_kind(local)!r} is "
            "not supported (only 'default')"
        )
    theta = float(glob.pop("rope_theta", 1e6))
    scaling = None if _rope_kind(glob) == "default" else glob
    heads = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id", 1)
    return Gemma3Config(
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=n,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or 256),
        layer_types=tuple(types),
        sliding_window=hf.get("sliding_window", 4096),
        query_pre_attn_scalar=hf.get("query_pre_attn_scalar", 256),
        rope_theta=theta,
        rope_local_theta=float(local.get("rope_theta", 1e4)),
        rope_scaling=scaling,
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 131_072)),
        dtype=dtype,
        param_dtype=dtype if param_dtype is None else param_dtype,
        initializer_range=float(hf.get("initializer_range", 0.02)),
        pad_token_id=hf.get("pad_token_id", 0),
        bos_token_id=hf.get("bos_token_id", 2),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        **runtime,
    )


def gemma3_hf_config(c: Gemma3Config) -> dict[str, Any]:
    """The config.json transformers writes for `Gemma3ForCausalLM` of `c`."""
    glob = {**(c.rope_scaling or {"rope_type": "default"}), "rope_theta": float(c.rope_theta)}
    eos = list(c.eos_token_id) if isinstance(c.eos_token_id, tuple) else c.eos_token_id
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": c.family,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": c.max_position_embeddings,
        "initializer_range": c.initializer_range,
        "rms_norm_eps": c.rms_eps,
        "use_cache": True,
        "pad_token_id": c.pad_token_id,
        "eos_token_id": eos,
        "bos_token_id": c.bos_token_id,
        "tie_word_embeddings": c.tie_embeddings,
        "rope_parameters": {
            FULL: glob,
            SLIDING: {"rope_type": "default", "rope_theta": float(c.rope_local_theta)},
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "query_pre_attn_scalar": c.query_pre_attn_scalar,
        "sliding_window": c.sliding_window,
        "layer_types": list(c.layer_types),
        **_HF_ZERO,
        "dtype": dtype_name(c.param_dtype),
    }
