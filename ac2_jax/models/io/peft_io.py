"""LoRA adapters in and out: PEFT's format, merging, and the serving bank's slots.

PEFT's format (what `peft.PeftModel.from_pretrained`, SGLang's and vLLM's LoRA
loaders read) is a directory with `adapter_config.json` (peft_type "LORA",
r, lora_alpha, target_modules, use_rslora, ...) and
`adapter_model.safetensors` holding, per adapted projection,
`base_model.model.model.layers.{i}.{self_attn|mlp}.{name}_proj.lora_A.weight`
[r, in] and `...lora_B.weight` [out, r] (ours are [in, r] and [r, out]).

    save_peft_adapter(model, "out/adapter")          # the adapters alone
    model = load_peft_adapter(base_model, "out/adapter")   # base + adapters
    full = merge_lora(model)                          # W + scale * A B, no adapters
    save_hf_checkpoint(full, "out/merged")            # a plain HF checkpoint

A bank model (`LoRAConfig(slots=N)`, for serving) takes adapters into slots:
`write_slot(bank, slot, adapters, lora)` with any model's `adapter_params`.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from ac2_jax.models.decoder import Decoder
from ac2_jax.models.family import build_model
from ac2_jax.models.io.hf_io import fresh_adapters
from ac2_jax.models.lora import LoRAConfig, LoRAScale, adapter_params
from ac2_jax.models.stacking import to_layout

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "add_lora",
    "load_peft_adapter",
    "merge_lora",
    "read_peft_config",
    "save_peft_adapter",
    "write_slot",
]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_MODULE = {"q": "self_attn", "k": "self_attn", "v": "self_attn", "o": "self_attn"}
_MODULE.update({"gate": "mlp", "up": "mlp", "down": "mlp"})
# adapter_config.json fields whose non-default values we cannot honour (refused by name).
_UNSUPPORTED = {
    "bias": "none",
    "use_dora": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "fan_in_fan_out": False,
    "exclude_modules": None,
    "trainable_token_indices": None,
    "lora_bias": False,
    "use_qalora": False,
    "target_parameters": None,
}


def _lora(model: Decoder) -> LoRAConfig:
    lora = model.config.lora
    if lora is None:
        raise ValueError("the model has no LoRA adapters (DecoderConfig.lora is None)")
    return lora


def _per_layer_adapters(model: Decoder) -> dict:
    """{layer: {module: {name_lora: {"a", "b"}}}} as numpy, per-layer layout."""
    params = to_layout(adapter_params(model), stacked=False)
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params["layers"])


def save_peft_adapter(
    model: Decoder, path: str, base_model_name_or_path: str | None = None
) -> None:
    """Writes `model`'s adapters (one adapter, not a bank) in PEFT's format at `path`."""
    lora = _lora(model)
    if lora.slots is not None:
        raise ValueError("save_peft_adapter: the model is an adapter bank; save one adapter")
    tensors = {}
    for i, layer in _per_layer_adapters(model).items():
        for module, entries in layer.items():
            for key, ab in entries.items():
                name = key.removesuffix("_lora")
                prefix = f"base_model.model.model.layers.{i}.{module}.{name}_proj"
                tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(ab["a"].T)
                tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(ab["b"].T)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "use_rslora": lora.rslora,
        "target_modules": sorted(f"{t}_proj" for t in lora.targets),
        "lora_dropout": 0.0,
        "init_lora_weights": True,
        "inference_mode": True,
        **_UNSUPPORTED,
    }
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})


def read_peft_config(path: str) -> LoRAConfig:
    """The LoRAConfig of a PEFT adapter directory (ValueError naming any field we
    cannot honour)."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.exists(file):
        raise FileNotFoundError(f"read_peft_config: no {CONFIG_FILE} in {path}")
    with open(file) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"read_peft_config: peft_type {cfg.get('peft_type')!r}; only LORA loads")
    for field, default in _UNSUPPORTED.items():
        value = cfg.get(field, default)
        if value != default and value not in (None, {}, [], False):
            raise ValueError(
                f"read_peft_config: {CONFIG_FILE} sets {field}={cfg[field]!r}, which ac2_jax's "
                f"LoRA does not support (it needs {default!r})"
            )
    targets = cfg.get("target_modules")
    if isinstance(targets, str):
        raise ValueError(
            f"read_peft_config: target_modules is a regex ({targets!r}); list the names"
        )
    return LoRAConfig(
        rank=int(cfg["r"]),
        alpha=float(cfg["lora_alpha"]),
        targets=tuple(str(t).rsplit(".", 1)[-1] for t in targets),
        rslora=bool(cfg.get("use_rslora", False)),
    )


def load_peft_adapter(model: Decoder, path: str, **lora_overrides: Any) -> Decoder:
    """A new Decoder: `model`'s base weights (shared, not copied) with the PEFT
    adapter at `path`. `lora_overrides` set other LoRAConfig fields (e.g.
    base_dtype). Every tensor of the file must be used and every adapter filled."""
    lora = read_peft_config(path)
    for k, v in lora_overrides.items():
        lora = LoRAConfig(**{**lora.to_dict(), k: v})
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    config = model.config.replace(lora=lora)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(config)))
    base = dict(nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.Any(nnx.LoRAParam, LoRAScale)))))
    used, leaves = set(), []
    for key, var in nnx.to_flat_state(state):
        if key in base and not isinstance(var, nnx.LoRAParam):
            leaves.append((key, base[key]))
            continue
        # ("layers", [i,] module, name_lora, "a"|"b")
        stacked = config.scan_layers
        layers = range(config.num_layers) if stacked else [key[1]]
        module, name, ab = str(key[-3]), str(key[-2]).removesuffix("_lora"), str(key[-1])
        parts = []
        for i in layers:
            hf = f"base_model.model.model.layers.{i}.{module}.{name}_proj.lora_{ab.upper()}.weight"
            if hf not in tensors:
                raise KeyError(f"load_peft_adapter: tensor {hf!r} missing from {path}")
            arr = tensors[hf].T
            want = var.shape[1:] if stacked else var.shape
            if arr.shape != tuple(want):
                raise ValueError(
                    f"load_peft_adapter: {hf} has shape {arr.T.shape}, expected {tuple(want)[::-1]}"
                )
            parts.append(arr)
            used.add(hf)
        value = np.stack(parts) if stacked else parts[0]
        leaves.append((key, var.replace(jnp.asarray(value, var.dtype))))
    unused = sorted(set(tensors) - used)
    if unused:
        raise ValueError(
            f"load_peft_adapter: {len(unused)} tensors of {path} fit no adapter of "
            f"this model, e.g. {unused[0]!r}"
        )
    return cast(Decoder, nnx.merge(graphdef, nnx.from_flat_state(leaves)))


def add_lora(model: Decoder, lora: LoRAConfig, seed: int = 0) -> Decoder:
    """A new Decoder: `model`'s weights (shared, not copied; base_dtype casts them)
    with fresh adapters of `lora` (A drawn from `seed`, B = 0: the outputs are
    `model`'s). `model` must have no adapters yet."""
    if model.config.lora is not None:
        raise ValueError("add_lora: the model has adapters already (merge_lora first)")
    config = model.config.replace(lora=lora)
    fresh = fresh_adapters(config, seed)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(config)))
    base = dict(nnx.to_flat_state(nnx.state(model)))
    new = dict(nnx.to_flat_state(fresh))
    leaves = []
    for key, var in nnx.to_flat_state(state):
        if key in new:
            leaves.append((key, new[key]))
        else:
            value = base[key][...]
            leaves.append((key, var.replace(value.astype(var.dtype))))
    return cast(Decoder, nnx.merge(graphdef, nnx.from_flat_state(leaves)))


def merge_lora(model: Decoder) -> Decoder:
    """A Decoder without adapters whose weights are W + scale * A B (in fp32, stored
    in the config's param_dtype): what the LoRA model computes, as one matrix."""
    lora = _lora(model)
    if lora.slots is not None:
        raise ValueError("merge_lora: the model is an adapter bank; merge one adapter")
    config = model.config.replace(lora=None)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(config)))
    own = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    values = nnx.to_pure_dict(state)

    def walk(src: dict, dst: dict):
        for k in dst:
            if isinstance(dst[k], dict):
                walk(src[k], dst[k])
                continue
            w = jnp.asarray(src[k], jnp.float32)
            ad = (
                src.get(f"{str(k).removesuffix('_proj')}_lora")
                if str(k).endswith("_proj")
                else None
            )
            if ad is not None:
                a, b = (jnp.asarray(ad[x], jnp.float32) for x in ("a", "b"))
                w = w + lora.scale * jnp.einsum("...ir,...ro->...io", a, b)
            dst[k] = w.astype(dst[k].dtype)

    walk(own, values)
    nnx.replace_by_pure_dict(state, values)
    return cast(Decoder, nnx.merge(graphdef, state))


@functools.partial(jax.jit, static_argnames=("slot", "rank"))
def _with_slot(values: dict, src: dict, slot: int, rank: int) -> dict:
    """`values` (the bank's LoRA params, a pure dict) with slot `slot` of every array
    replaced by src's array there, zero-padded from `rank` to the bank's rank, or by
    zeros where src has none: one program per bank and adapter layout (eagerly, three
    small ops per array, each compiled per shape)."""

    def walk(src: dict | None, dst: dict) -> dict:
        out = {}
        for k in dst:
            if isinstance(dst[k], dict):
                out[k] = walk(None if src is None else src.get(k), dst[k])
                continue
            x = dst[k]  # [..., N, in, r] or [..., N, r, out]
            new = jnp.zeros(x.shape[:-3] + x.shape[-2:], x.dtype)
            if src is not None:
                part = jnp.asarray(src[k], x.dtype)
                new = new.at[..., :rank].set(part) if k == "a" else new.at[..., :rank, :].set(part)
            at = (slice(None),) * (x.ndim - 3) + (slot,)  # the slot axis
            out[k] = x.at[at].set(new)
        return out

    return walk(src, values)


def write_slot(bank: Decoder, slot: int, adapters: dict, lora: LoRAConfig) -> None:
    """Puts one adapter (`adapter_params` of a model with `lora`, either layer
    layout) into slot `slot` of `bank` (a model with `LoRAConfig(slots=N)`), in
    place: its rank may be lower than the bank's (zero-padded), its targets a
    subset (the others' slot is zeroed). Shapes do not change: nothing recompiles.
    Slot 0 is the base model and cannot be written."""
    bank_lora = _lora(bank)
    if bank_lora.slots is None:
        raise ValueError("write_slot: the model is not an adapter bank (LoRAConfig.slots)")
    if not 1 <= int(slot) < bank_lora.slots:
        raise ValueError(f"write_slot: slot must be in 1..{bank_lora.slots - 1}, got {slot}")
    if lora.rank > bank_lora.rank:
        raise ValueError(f"write_slot: adapter rank {lora.rank} > the bank's {bank_lora.rank}")
    extra = set(lora.targets) - set(bank_lora.targets)
    if extra:
        raise ValueError(f"write_slot: adapter targets {sorted(extra)} are not in the bank's")
    src = to_layout(adapters, stacked=bool(bank.config.scan_layers)) if adapters else {}
    state = nnx.state(bank, nnx.LoRAParam)
    values = nnx.to_pure_dict(state)

    def placed(src: dict | None, dst: dict) -> int:  # src's arrays that have a place
        n = 0
        for k in dst:
            if isinstance(dst[k], dict):
                n += placed(None if src is None else src.get(k), dst[k])
            elif src is not None:
                src[k]  # noqa: B018 - a module of src without this array: KeyError
                n += 1
        return n

    written = placed(src, values)
    if written != len(jax.tree.leaves(src)):
        raise ValueError(
            f"write_slot: {len(jax.tree.leaves(src)) - written} adapter arrays fit no "
            "place in the bank (another architecture, or layer keys not 0..n-1)"
        )
    values = _with_slot(values, src, int(slot), int(lora.rank))
    nnx.replace_by_pure_dict(state, values)
    nnx.update(bank, state)
    bank.lora_scale.value = bank.lora_scale.value.at[slot].set(lora.scale)
