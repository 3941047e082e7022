"""HF checkpoint I/O: `config.json` + safetensors <-> a model of a registered family
(Qwen3, Llama, Qwen2, Mistral: `Decoder`; Gemma 3: `models.gemma3.Gemma3`), built by
`build_model` from the config its `model_type` reads.

Reads and writes with the `safetensors` numpy API (no torch). Our matrices
are [in, out]; HF's are [out, in], so 2-D weights other than the embedding
are transposed on the way. Tied models carry no `lm_head.weight`. A model
with stacked layers (`scan_layers=True`) reads and writes the same per-layer
HF tensors (`model.layers.{i}...`): stacking is internal.
"""

from __future__ import annotations

import gc
import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from ac2_jax.models.config import DecoderConfig, resolve_config
from ac2_jax.models.decoder import Decoder
from ac2_jax.models.family import build_model, config_from_hf, get_family
from ac2_jax.models.lora import LoRAScale

_ADAPTER = nnx.Any(nnx.LoRAParam, LoRAScale)  # the variables a base checkpoint lacks

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_COLLECT_BYTES = 8 * 2**20  # host arrays freed at once from this size (`_load_leaf`)
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


_BIASES = {"q_bias": "q_proj.bias", "k_bias": "k_proj.bias", "v_bias": "v_proj.bias"}


def _hf_name(path: tuple) -> str:
    if str(path[-1]) in _BIASES:  # Qwen2's attention biases
        return "model." + ".".join([*(str(p) for p in path[:-1]), _BIASES[str(path[-1])]])
    name = ".".join(str(p) for p in path)
    if name == "lm_head":
        return "lm_head.weight"
    if name == "embed_tokens":
        return "model.embed_tokens.weight"
    return "model." + (name if name.endswith(".weight") else name + ".weight")


def _transposed(path: tuple, ndim: int) -> bool:
    return ndim == 2 and path[-1] != "embed_tokens"


def _per_layer(key: tuple, config: DecoderConfig) -> list[tuple]:
    """The per-layer param paths a model param `key` holds: itself, or one per
    layer when the layers are stacked."""
    if config.scan_layers and key[0] == "layers":
        return [("layers", i, *key[1:]) for i in range(config.num_layers)]
    return [key]


def _abstract(config: DecoderConfig):
    return nnx.split(nnx.eval_shape(lambda: build_model(config, nnx.Rngs(0))))


def _read_tensors(path: str) -> dict[str, Any]:
    """name -> lazy reader over all safetensors files of an HF directory."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(path, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"load_hf_checkpoint: no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    readers = {}
    for fname in files:
        with safe_open(os.path.join(path, fname), framework="np") as f:
            for key in f.keys():
                readers[key] = os.path.join(path, fname)
    return readers


def load_hf_config(
    path: str, dtype: Any = jnp.float32, param_dtype: Any = None, **runtime
) -> DecoderConfig:
    """The DecoderConfig of a local HF directory's config.json, reading no weights
    (e.g. for an abstract model: compile and memory analysis before loading). Pure
    data: runtime fields left out stay "auto" (`resolve_config` decides them)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"load_hf_checkpoint: no config.json in {path}")
    with open(cfg_path) as f:
        return config_from_hf(json.load(f), dtype=dtype, param_dtype=param_dtype, **runtime)


def load_hf_checkpoint(
    path: str, dtype: Any = jnp.float32, param_dtype: Any = None, **runtime
) -> tuple[Decoder, DecoderConfig]:
    """Builds a Decoder from a local HF directory (config.json + safetensors).

    `dtype` is the compute dtype; weights are stored in `param_dtype`
    (default: `dtype`). `runtime` sets DecoderConfig's runtime fields
    (scan_layers, remat, attention_backend, attention_block, lora); those left
    out keep their defaults: scan_layers / remat "auto", chosen (and logged) by
    `models.memory_plan` from the model's size and the device's memory, once
    (`resolve_config`): the returned config is the model's, resolved. Sharded
    checkpoints (with an index) are read too. With `lora` (a `LoRAConfig`)
    the checkpoint is the frozen base and the adapters start fresh (B = 0:
    the model's outputs are the base's).
    """
    # resolved once here: the tensor layout below reads scan_layers, and the model is
    # built from this same config (so the plan is not asked again)
    config = resolve_config(load_hf_config(path, dtype, param_dtype, **runtime))
    own = getattr(get_family(config.family), "load_hf_weights", None)
    if own is not None:  # a family with its own tensor layout (MoE experts: models.qwen3_moe)
        return own(config, path), config
    where = _read_tensors(path)
    graphdef, state = _abstract(config)
    leaves = []
    adapters = dict(nnx.to_flat_state(fresh_adapters(config))) if config.lora else {}
    for key, var in nnx.to_flat_state(state):
        if key in adapters:
            leaves.append((key, adapters[key]))
            continue
        leaves.append((key, var.replace(_load_leaf(path, where, key, var, config))))
    model = nnx.merge(graphdef, nnx.from_flat_state(leaves))
    return model, config


def _load_leaf(path: str, where: dict, key: tuple, var, config: DecoderConfig) -> jax.Array:
    """One model param from its HF tensors (one per layer when stacked), in the param's
    dtype. Memory: the leaf is filled in place in one host array of its final dtype
    (no list of per-layer copies, no stacked copy, no cast copy), and each tensor's
    file is closed once read, so the pages it mapped leave the process; the load's
    high-water mark is the model plus about one leaf
    (docs/notes/2026-12-05-lora-memory-time-publish-real-size.md)."""
    layer_keys = _per_layer(key, config)
    stacked = len(layer_keys) > 1
    want = tuple(var.shape[1:] if stacked else var.shape)
    out = np.empty(var.shape, dtype=np.dtype(var.dtype))
    for i, layer_key in enumerate(layer_keys):
        name = _hf_name(layer_key)
        if name not in where:
            raise KeyError(f"load_hf_checkpoint: tensor {name!r} missing from {path}")
        with safe_open(where[name], framework="np") as f:
            arr = f.get_tensor(name)
        arr = arr.T if _transposed(layer_key, arr.ndim) else arr
        if arr.shape != want:
            raise ValueError(
                f"load_hf_checkpoint: {name} has shape {arr.shape}, config expects {want}"
            )
        out[i if stacked else ...] = arr  # casts to the param dtype
        del arr
    value = jnp.asarray(out).block_until_ready()
    if out.nbytes >= _COLLECT_BYTES:
        # The transfer leaves `out` in a reference cycle (jax 0.10, measured with
        # tracemalloc): without a collection it lives on beside the next leaf's.
        del out
        gc.collect()
    return value


def fresh_adapters(config: DecoderConfig, seed: int = 0) -> nnx.State:
    """The adapter variables (LoRA A, B; a bank's scales) a model of `config` built
    with `nnx.Rngs(seed)` starts with, computed without materialising its base
    weights (XLA drops them)."""
    return jax.jit(lambda: nnx.state(build_model(config, nnx.Rngs(seed)), _ADAPTER))()


def hf_state_dict(model: Decoder) -> dict[str, np.ndarray]:
    """HF-named numpy weights of `model` (in its param dtype, [out, in] layout).
    A model with LoRA adapters has no such form: merge them first
    (`models.io.peft_io.merge_lora`) or save them in PEFT's (`save_peft_adapter`)."""
    if model.config.lora is not None:
        raise ValueError(
            "hf_state_dict / save_hf_checkpoint: the model has LoRA adapters; save a full "
            "checkpoint of merge_lora(model), or the adapters alone with save_peft_adapter"
        )
    own = getattr(get_family(model.config.family), "hf_state_dict", None)
    if own is not None:  # a family with its own tensor layout (MoE experts: models.qwen3_moe)
        return own(model)
    out = {}
    for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        arr = np.asarray(jax.device_get(var[...]))
        layer_keys = _per_layer(key, model.config)
        arrays = [arr] if len(layer_keys) == 1 else list(arr)
        for layer_key, a in zip(layer_keys, arrays, strict=True):
            out[_hf_name(layer_key)] = np.ascontiguousarray(
                a.T if _transposed(layer_key, a.ndim) else a
            )
    return out


def save_hf_checkpoint(model: Decoder, path: str, max_shard_bytes: int | None = None) -> None:
    """Writes config.json + safetensors that `AutoModelForCausalLM.from_pretrained` loads.

    With `max_shard_bytes`, tensors are split over `model-0000i-of-0000n`
    files plus `model.safetensors.index.json` (one tensor per file at least).
    """
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model.config.to_hf_config(), f, indent=2)
    tensors = hf_state_dict(model)
    meta = {"format": "pt"}
    for stale in os.listdir(path):  # an earlier save's files would confuse loaders
        if stale in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.fullmatch(stale):
            os.remove(os.path.join(path, stale))
    if max_shard_bytes is None:
        save_file(tensors, os.path.join(path, SINGLE_FILE), metadata=meta)
        return
    if max_shard_bytes <= 0:
        raise ValueError(f"save_hf_checkpoint: max_shard_bytes must be > 0, got {max_shard_bytes}")
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].nbytes
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += n
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata=meta)
        weight_map.update({name: fname for name in shard})
    index = {
        "metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
        "weight_map": weight_map,
    }
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
