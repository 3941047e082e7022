"""ModelConfig: the fields and checks every family's config shares; DecoderConfig: the
shape of a Qwen3 / Llama style decoder, and its HF form.

`to_hf_config` / `from_hf_config` map to the `config.json` of the config's
family (`models.family`; the built-in ones, in `models/families.py`:
`Qwen3ForCausalLM`, `LlamaForCausalLM`), so checkpoints move both ways.
`decoder_hf_config` / `decoder_config_from_hf` are the fields every family of
this decoder shares; a family adds its own.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, ClassVar, Literal, Self, TypeVar

import jax.numpy as jnp

from ac2_jax.models.family import FAMILIES, config_from_hf, get_family
from ac2_jax.models.kernels.attention import ATTENTION_BACKENDS
from ac2_jax.models.lora import LoRAConfig

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
REMAT = ("none", "full", "save_dots")
RUNTIME_FIELDS = (
    "scan_layers",
    "remat",
    "attention_backend",
    "attention_block",
    "mlp_backward",
    "proj_backward",
    "lora",
)
BACKWARDS = ("custom", "autodiff")
# The runtime fields whose "auto" the memory plan decides, once, in `resolve_config`.
PLANNED = ("scan_layers", "remat")


def dtype_name(dtype: Any) -> str:
    """'float32' / 'bfloat16' / 'float16' for a jnp dtype (or its name)."""
    name = jnp.dtype(dtype).name
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return name


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The fields and checks every family's config shares (subclass it: a family adds
    its own fields, `_normalize` / `_check` hooks, `ROPE_TYPES` and `TINY`). Every
    subclass hashes by its fields' reprs, as this class does (`__init_subclass__`
    installs the hash: a subclass need not repeat it), so a config is a jit static arg.

    `dtype` is the compute dtype (activations, KV cache), `param_dtype` the
    storage dtype of the weights; logits are always fp32. `qk_norm` applies a
    per-head RMSNorm to q and k before RoPE (Qwen3). `attention_bias` adds
    biases to the q, k and v projections, not o (Qwen2). `sliding_window`:
    None, or a windowed layer's query at position p sees only keys at
    positions > p - sliding_window of its own segment (Mistral: every layer;
    a family with per-layer kinds says which); the KV cache then holds at
    most that many slots per row for those layers (`init_cache`).
    `rope_scaling` is None or an HF rope dict of one of `ROPE_TYPES`.

    A config is pure data: building one checks only its own fields (types,
    ranges, relations between them); it reads no registry, device or JAX backend.
    The family registry, the LoRA targets and the memory plan are `resolve_config`'s,
    run where the model is built (`Transformer.__init__`, `load_hf_checkpoint`).

    Runtime choices (not in the HF config; `RUNTIME_FIELDS`):
    `scan_layers` and `remat` default to "auto" and stay "auto" in the config:
    `resolve_config` has `models.memory_plan` pick them (and log why):
    scan_layers=True with remat="full" for models of >= 100M params or whose
    fast plan would not fit half the device's memory, else per-layer and "none".
    An explicit value is kept. A model's `config` is always resolved; a config
    with "auto" and its resolved copy are different configs (equality, hash).
    `scan_layers` stores the layers' params stacked [num_layers, ...] and runs
    them under `jax.lax.scan` (compile time independent of depth). Decoding
    then copies each layer's weights and cache slice out of the stacked
    arrays every step (on CPU about 1.6x the per-layer step time for a small
    model); a CPU sampler may keep per-layer params, as checkpoints load
    across the two layouts.
    `remat` is what the backward pass recomputes per layer: "none", "full"
    (everything but the layer input) or "save_dots" (keeps the outputs of
    the weight matmuls, recomputes attention and elementwise ops); True /
    False mean "full" / "none".
    `attention_backend` picks the attention kernel (`models.kernels.attention`):
    "auto" chooses by platform and shape; `attention_block` is its tile size.
    `mlp_backward` is how the SwiGLU MLP's gradients are formed: "custom"
    (`models.layers.swiglu`, a custom VJP whose weight gradients contract
    over the token axes, so XLA:CPU makes no transposed copy of d(gate) /
    d(up)) or "autodiff" (JAX's own transpose of the forward). Same values.
    `proj_backward` likewise for the attention's q/k/v/o projections:
    "custom" (`models.layers.linear`, weight gradients x^T dy contracting
    the token axes as they lie) or "autodiff".
    `lora`: None, or a `models.lora.LoRAConfig`: the model then holds
    low-rank adapters on the projections it names (a dict is read as one).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # The rest by keyword only: a family's config adds fields with its own defaults
    # (Gemma3Config), so positions past head_dim would mean different fields per family.
    _: dataclasses.KW_ONLY
    qk_norm: bool = True
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    tie_embeddings: bool = False
    max_position_embeddings: int = 32768
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    family: str = "qwen3"
    attention_bias: bool = False
    rope_scaling: dict | None = None
    sliding_window: int | None = None
    initializer_range: float = 0.02
    remat: str | bool = "auto"
    scan_layers: bool | Literal["auto"] = "auto"
    attention_backend: str = "auto"
    attention_block: int = 128
    mlp_backward: str = "custom"
    proj_backward: str = "custom"
    lora: LoRAConfig | None = None

    ROPE_TYPES: ClassVar[tuple[str, ...]] = ("default", "llama3")
    # `tiny()`'s fields: a few-thousand-parameter model for tests and CPU demos.
    TINY: ClassVar[dict[str, Any]] = dict(
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qk_norm=True,
        rope_theta=10000.0,
        tie_embeddings=True,
        max_position_embeddings=2048,
    )

    def _normalize(self) -> None:
        """A family's hook: fills or converts its own fields before the checks."""

    def _check(self) -> None:
        """A family's hook: raises ValueError on what its own fields rule out."""

    def __post_init__(self):
        name = type(self).__name__
        if isinstance(self.remat, bool):
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        if isinstance(self.lora, dict):
            object.__setattr__(self, "lora", LoRAConfig(**self.lora))
        self._normalize()
        if self.remat not in (*REMAT, "auto"):
            raise ValueError(
                f"{name}.remat must be one of {REMAT}, 'auto' (or a bool), got {self.remat!r}"
            )
        if isinstance(self.scan_layers, str) and self.scan_layers != "auto":
            raise ValueError(
                f"{name}.scan_layers must be a bool or 'auto', got {self.scan_layers!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"{name}.attention_backend must be one of "
                f"{ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        for field in ("mlp_backward", "proj_backward"):
            if getattr(self, field) not in BACKWARDS:
                raise ValueError(
                    f"{name}.{field} must be one of {BACKWARDS}, got {getattr(self, field)!r}"
                )
        if int(self.attention_block) < 8 or int(self.attention_block) % 8:
            raise ValueError(
                f"{name}.attention_block must be a multiple of 8 (>= 8), got {self.attention_block}"
            )
        if self.sliding_window is not None and int(self.sliding_window) <= 0:
            raise ValueError(
                f"{name}.sliding_window must be None or > 0, got {self.sliding_window}"
            )
        for field in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if int(getattr(self, field)) <= 0:
                raise ValueError(f"{name}.{field} must be > 0, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{name}: num_heads ({self.num_heads}) must be a multiple "
                f"of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"{name}.head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in self.ROPE_TYPES:
                raise ValueError(
                    f"{name}.rope_scaling: rope_type {kind!r} is not supported "
                    f"(only {' and '.join(repr(t) for t in self.ROPE_TYPES)})"
                )
        dtype_name(self.dtype), dtype_name(self.param_dtype)
        if self.lora is not None and not isinstance(self.lora, LoRAConfig):
            raise TypeError(
                f"{name}.lora must be None or a LoRAConfig, got {type(self.lora).__name__}"
            )
        if not isinstance(self.family, str) or not self.family:
            raise ValueError(
                f"{name}.family must be a non-empty string (a registered model_type), "
                f"got {self.family!r}"
            )
        self._check()

    @property
    def is_resolved(self) -> bool:
        """Whether no field is left to the memory plan (`PLANNED` fields not "auto")."""
        return all(getattr(self, f) != "auto" for f in PLANNED)

    @property
    def base_dtype(self) -> Any:
        """The storage dtype of the base weights: `lora.base_dtype` if set, else param_dtype."""
        if self.lora is not None and self.lora.base_dtype is not None:
            return jnp.dtype(self.lora.base_dtype)
        return self.param_dtype

    @classmethod
    def tiny(cls, vocab_size: int = 256, **overrides) -> Self:
        """A few-thousand-parameter model of this config class (`TINY`, then `overrides`)."""
        return cls(**{"vocab_size": vocab_size, **cls.TINY, **overrides})

    def __hash__(self):  # rope_scaling is a dict; the config must stay hashable (static arg)
        return hash(
            repr(sorted((f.name, repr(getattr(self, f.name))) for f in dataclasses.fields(self)))
        )

    def __init_subclass__(cls, **kwargs):
        # A frozen dataclass subclass would get dataclasses' field-tuple hash (it fails on
        # rope_scaling's dict, first when the config is a jit static arg): this hash goes
        # in the class dict before @dataclass runs, which then keeps it. A subclass that
        # writes its own __hash__ keeps that one.
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("__hash__") is None:
            cls.__hash__ = ModelConfig.__hash__

    def replace(self, **changes) -> Self:
        return dataclasses.replace(self, **changes)

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `config.json` dict of this config's family (e.g. Qwen3ForCausalLM)."""
        return get_family(self.family).config_to_hf(self)

    @classmethod
    def from_hf_config(
        cls, hf: dict[str, Any], dtype: Any = jnp.float32, param_dtype: Any = None, **runtime
    ) -> Self:
        """Reads an HF `config.json` dict of a causal LM whose family's config is this
        class (by its model_type). `runtime` may set the fields of `RUNTIME_FIELDS` (e.g.
        scan_layers=True)."""
        config = config_from_hf(hf, dtype=dtype, param_dtype=param_dtype, **runtime)
        if not isinstance(config, cls):
            raise ValueError(
                f"from_hf_config: model_type {hf.get('model_type')!r} is a "
                f"{type(config).__name__}, not a {cls.__name__}"
            )
        return config


_C = TypeVar("_C", bound=ModelConfig)


def resolve_config(config: _C) -> _C:
    """The config a model and its train step are built with: the one place the family
    registry is checked and the memory plan decides.

    - `config.family` must be a registered family (`models.family.FAMILIES`) whose
      config class is `type(config)`: else a ValueError listing this class's families
      (and the closest name);
    - `config.lora`'s targets must be adaptable in that family (`check_lora_targets`);
    - each of `PLANNED` (scan_layers, remat) still "auto" is replaced by
      `models.memory_plan`'s choice for the model's shape and the device's memory
      (one INFO line on logger `ac2_jax.models.memory_plan` says which and why).
      Explicit values are kept.

    Returns `config` itself when nothing was "auto", else a copy (`replace`), so it is
    idempotent and a resolved config costs only the checks. `Transformer.__init__`
    calls it, so a model's `config` is always resolved; code that reads `scan_layers` /
    `remat` from a config without building a model (e.g. `load_hf_checkpoint`'s
    tensor layout) resolves it first and passes the result on. Never starts a JAX
    backend (the plan reads the first device's memory only if one is up, else the
    host's)."""
    name = type(config).__name__
    if config.family not in FAMILIES or get_family(config.family).config_class is not type(config):
        names = [n for n in FAMILIES.names() if get_family(n).config_class is type(config)]
        close = difflib.get_close_matches(str(config.family), names, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"{name}.family must be a registered family of this decoder "
            f"({', '.join(names) or 'none'}), got {config.family!r}{hint} "
            "(register one with @register_family)"
        )
    if config.lora is not None:
        get_family(config.family).check_lora_targets(config.lora.targets)
    if config.is_resolved:
        return config
    from ac2_jax.models.memory_plan import resolve_runtime

    planned = resolve_runtime(config)
    return config.replace(**{f: planned[f] for f in PLANNED if getattr(config, f) == "auto"})


@dataclasses.dataclass(frozen=True)
class DecoderConfig(ModelConfig):
    """Hyper-parameters of the dense decoder (Qwen3, Llama, Qwen2 / Qwen2.5, Mistral):
    `ModelConfig`'s fields, every layer alike (`sliding_window` windows every layer)."""


def decoder_hf_config(config: DecoderConfig, architecture: str) -> dict[str, Any]:
    """The `config.json` fields every family of this decoder shares."""
    rope = {"rope_type": "default", "rope_theta": float(config.rope_theta)}
    if config.rope_scaling is not None:
        rope = {**config.rope_scaling, "rope_theta": float(config.rope_theta)}
    return {
        "architectures": [architecture],
        "model_type": config.family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_eps,
        "rope_theta": float(config.rope_theta),
        "rope_scaling": config.rope_scaling,
        "rope_parameters": rope,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "initializer_range": config.initializer_range,
        "torch_dtype": dtype_name(config.param_dtype),
        "dtype": dtype_name(config.param_dtype),
        "use_cache": True,
    }


def decoder_config_from_hf(
    hf: dict[str, Any],
    *,
    qk_norm: bool,
    attention_bias: bool = False,
    sliding_window: int | None = None,
    dtype: Any = jnp.float32,
    param_dtype: Any = None,
    **runtime,
) -> DecoderConfig:
    """A DecoderConfig from the `config.json` fields every family of this decoder
    shares (`family` = hf["model_type"]); `qk_norm`, `attention_bias` (q/k/v
    biases) and `sliding_window` are the family's."""
    bad = sorted(set(runtime) - set(RUNTIME_FIELDS))
    if bad:
        raise ValueError(
            f"from_hf_config: {bad} come from config.json; only {RUNTIME_FIELDS} may be passed"
        )
    model_type = hf.get("model_type")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"from_hf_config: hidden_act {hf['hidden_act']!r} is not supported")
    if (hf.get("attention_bias", False) and not attention_bias) or hf.get("mlp_bias", False):
        raise ValueError(
            f"from_hf_config: attention_bias / mlp_bias are not supported for {model_type!r} "
            "(an o_proj / MLP bias); only Qwen2's q/k/v biases are (model_type 'qwen2')"
        )
    sliding = sliding_layers(hf)
    if sliding:
        raise ValueError(
            f"from_hf_config: {model_type!r} config.json has sliding-window layers {sliding} "
            f"(use_sliding_window={hf.get('use_sliding_window')!r}, sliding_window="
            f"{hf.get('sliding_window')!r}, max_window_layers={hf.get('max_window_layers')!r}, "
            "layer_types); per-layer windows are not supported: set use_sliding_window to "
            "false (as Qwen2.5 / Qwen3 ship) or use a family whose every layer is windowed "
            "(model_type 'mistral')"
        )
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or None
    if scaling is None and rope.get("rope_type", "default") != "default":
        scaling = rope
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type")) == "default":
            scaling = None
    heads = hf["num_attention_heads"]
    return DecoderConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        qk_norm=qk_norm,
        rope_theta=float(theta),
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
        dtype=dtype,
        param_dtype=dtype if param_dtype is None else param_dtype,
        family=str(model_type),
        rope_scaling=scaling,
        attention_bias=attention_bias,
        sliding_window=sliding_window,
        initializer_range=float(hf.get("initializer_range", 0.02)),
        **runtime,
    )


def sliding_layers(hf: dict[str, Any]) -> list[int]:
    """The layers a Qwen-style `config.json` makes sliding-window layers, as
    transformers reads it: its `layer_types`, else, with `use_sliding_window`
    and a `sliding_window`, layers >= `max_window_layers`."""
    n = int(hf.get("num_hidden_layers", 0))
    types = hf.get("layer_types")
    if types is not None:
        return [i for i, t in enumerate(types) if t != "full_attention"]
    if not hf.get("use_sliding_window", False) or hf.get("sliding_window") is None:
        return []
    first = hf.get("max_window_layers")
    return list(range(int(first if first is not None else 0), n))
