"""LoRA: low-rank adapters on the decoder's projections (Hu et al., 2021).

A projection `y = x W` with an adapter on it computes

    y = x W + scale * (x A) B,      A [in, r], B [r, out], scale = alpha / r

(`rslora`: alpha / sqrt(r), Kalajdzievski 2023). A is drawn as PEFT draws it
(Kaiming-uniform), B starts at zero, so a fresh adapter leaves the model's
outputs exactly as they were. A and B are `nnx.LoRAParam`s beside the frozen
base weights; `trainable_filter(model)` is `nnx.LoRAParam` for a model that
has any, and the train state (`training.core.create_train_state`) then holds
the adapters as its params and the base weights in its `rest`: the
optimizer's state is the adapters' size, and the base needs no gradient.

Set `DecoderConfig.lora` (a runtime field: not in the HF config.json) and the
decoder builds the adapters itself (`models.layers`); `load_hf_checkpoint(path,
lora=LoRAConfig(rank=16))` loads the base and adds fresh adapters.

Serving several adapters on one base: `LoRAConfig(slots=N)` builds a bank of
N adapters (every A, B with a leading [N] axis, and a per-slot scale). Each
row of a decode names its slot (`Transformer.decode_with_outputs(..., adapter_ids=)`); slot 0
is kept empty, so it is the base model. Writing a slot (`write_slot`) changes
arrays, not shapes, so nothing recompiles; adapters of lower rank than the
bank are zero-padded (zero columns add nothing). Nothing is merged into a
copy of the base.

Why our own module and not qwix's LoRA: qwix adds adapters by intercepting
the `dot_general` / `einsum` calls a flax module makes, keyed by the module
path. Our layers are pure functions of stacked parameter dicts run under
`jax.lax.scan`, with custom VJPs on the projections (`models.layers`), so
there is no per-projection module call for it to intercept, and a bank of
adapters selected per row has no form there. The math is four lines
(`lora_delta`); the rest is bookkeeping this module keeps in one place.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
    "ATTENTION_TARGETS",
    "LoRAConfig",
    "LoRAScale",
    "MLP_TARGETS",
    "TARGETS",
    "adapter_params",
    "has_lora",
    "lora_delta",
    "lora_update",
    "trainable_filter",
]

ATTENTION_TARGETS = ("q", "k", "v", "o")
MLP_TARGETS = ("gate", "up", "down")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
_DTYPES = ("float32", "bfloat16", "float16")


class LoRAScale(nnx.Variable):
    """The per-slot scale [N] of an adapter bank (not trained, not a Param)."""


def _target(name: str) -> str:
    short = name.removesuffix("_proj")
    if short not in TARGETS:
        raise ValueError(
            f"LoRAConfig.targets: unknown target {name!r}; targets are {TARGETS} "
            "(or their HF names q_proj ... down_proj)"
        )
    return short


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters on the decoder's projections.

    rank: r; alpha: the scale's numerator (scale = alpha / r, or alpha /
    sqrt(r) with `rslora`); targets: which projections get one, by short name
    ("q", "k", "v", "o", "gate", "up", "down") or HF name ("q_proj", ...);
    base_dtype: None keeps the base weights in the model's param_dtype, else
    they are stored in this dtype ("bfloat16" halves their memory; they are
    frozen, so no precision is lost to updates); slots: None for one adapter
    (training), N for a bank of N serving slots (slot 0 is the base model).
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = TARGETS
    rslora: bool = False
    base_dtype: str | None = None
    slots: int | None = None

    def __post_init__(self):
        if isinstance(self.targets, str):
            raise TypeError("LoRAConfig.targets must be a sequence of names, not one string")
        targets = tuple(dict.fromkeys(_target(t) for t in self.targets))
        if not targets:
            raise ValueError("LoRAConfig.targets is empty; name at least one projection")
        object.__setattr__(self, "targets", targets)
        if int(self.rank) <= 0:
            raise ValueError(f"LoRAConfig.rank must be > 0, got {self.rank}")
        if not float(self.alpha) > 0:
            raise ValueError(f"LoRAConfig.alpha must be > 0, got {self.alpha}")
        if self.base_dtype is not None:
            name = jnp.dtype(self.base_dtype).name
            if name not in _DTYPES:
                raise ValueError(f"LoRAConfig.base_dtype must be one of {_DTYPES}, got {name!r}")
            object.__setattr__(self, "base_dtype", name)
        if self.slots is not None and int(self.slots) < 2:
            raise ValueError(
                f"LoRAConfig.slots must be None (one adapter) or >= 2 (slot 0 is the "
                f"base model), got {self.slots}"
            )

    @property
    def scale(self) -> float:
        """alpha / r (alpha / sqrt(r) with rslora)."""
        return float(self.alpha) / (math.sqrt(self.rank) if self.rslora else self.rank)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def lora_update(x: jax.Array, a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """scale * (x a) b for x [..., in], a [in, r], b [r, out] (one dtype), with a
    hand-written backward: the adapters' gradients are dot_generals contracting the
    token axes of both operands as they lie, as `layers.swiglu`'s weight gradients
    are (XLA:CPU otherwise copies the [..., out] cotangent transposed for them).
    Values and gradients equal autodiff's up to fp32 summation order
    (tests/models/test_lora.py)."""
    return _lora_update_fwd(x, a, b, scale)[0]


def _lora_update_fwd(x, a, b, scale):
    xa = jnp.einsum("...i,ir->...r", x, a)
    return jnp.einsum("...r,ro->...o", xa, b) * jnp.asarray(scale, x.dtype), (x, a, b, xa)


def _lora_update_bwd(scale, res, dy):
    x, a, b, xa = res
    toks = tuple(range(x.ndim - 1))
    tok_dot = functools.partial(jax.lax.dot_general, dimension_numbers=((toks, toks), ((), ())))
    dy = dy * jnp.asarray(scale, dy.dtype)
    dxa = jnp.einsum("...o,ro->...r", dy, b)
    return jnp.einsum("...r,ir->...i", dxa, a), tok_dot(x, dxa), tok_dot(xa, dy)


lora_update.defvjp(_lora_update_fwd, _lora_update_bwd)


def lora_delta(x: jax.Array, lw: dict, scale: float | None, rows: tuple | None, dtype) -> jax.Array:
    """scale * (x A) B for x [B, L, in] in `dtype`.

    lw: {"a": A, "b": B}: one adapter (A [in, r], B [r, out], static `scale`)
    or a bank (A [N, in, r], B [N, r, out]) with `rows` = (ids [B] int, scale
    [B] fp32): row b uses slot ids[b] and its scale.
    """
    a, b = lw["a"][...].astype(dtype), lw["b"][...].astype(dtype)
    if a.ndim == 2:
        assert scale is not None
        return lora_update(x, a, b, float(scale))
    if rows is None:
        raise ValueError(
            "lora_delta: an adapter bank needs each row's slot (pass adapter_ids to decode)"
        )
    ids, row_scale = rows
    h = jnp.einsum("bli,bir->blr", x, jnp.take(a, ids, axis=0))
    out = jnp.einsum("blr,bro->blo", h, jnp.take(b, ids, axis=0))
    return out * row_scale.astype(dtype)[:, None, None]


def has_lora(model: nnx.Module) -> bool:
    """Whether `model` holds any `nnx.LoRAParam`."""
    return bool(jax.tree.leaves(nnx.state(model, nnx.LoRAParam)))


def trainable_filter(model: nnx.Module):
    """What a train state trains: the adapters (`nnx.LoRAParam`) of a model that
    has them, else every `nnx.Param`."""
    return nnx.LoRAParam if has_lora(model) else nnx.Param


def adapter_params(model: nnx.Module) -> dict:
    """The adapters as a pure dict (the tree `publish_weights` writes for a LoRA model)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
