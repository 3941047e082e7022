"""The Qwen3-MoE and Qwen2-MoE families: `MoEDecoder` (`models.moe_decoder`) of a
`MoEDecoderConfig` (`models.moe`), and their HF config.json and safetensors.

Qwen3-MoE: qk-norm, no attention biases, no shared expert; `use_sliding_window`
windows every layer (as transformers' Qwen3MoeModel does). Qwen2-MoE: q/k/v
biases (`qkv_bias`), no qk-norm, a shared expert with a sigmoid gate; a
config.json that windows some layers is refused, as for Qwen2. Both adapt
only q, k, v, o with LoRA (experts and router carry none).

Checkpoints: the experts are per-expert HF tensors,
`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight` ([out, in], as
the Hub's Qwen3-MoE files and transformers' `save_pretrained` write them),
stacked here into [E, in, out]; the router is `mlp.gate.weight` [E, D]. The
fused layout transformers holds in memory (`mlp.experts.gate_up_proj`
[E, 2F, D], `mlp.experts.down_proj` [E, D, F]) is read too. `hf_io`'s
`load_hf_checkpoint` / `save_hf_checkpoint` call this family's
`load_hf_weights` / `hf_state_dict`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from ac2_jax.models.config import (
    DecoderConfig,
    decoder_config_from_hf,
    decoder_hf_config,
    resolve_config,
)
from ac2_jax.models.family import ModelFamily, register_family
from ac2_jax.models.io.hf_io import _ADAPTER, _hf_name, _read_tensors, _transposed
from ac2_jax.models.lora import ATTENTION_TARGETS
from ac2_jax.models.moe import MoEDecoderConfig
from ac2_jax.models.moe_decoder import MoEDecoder

__all__ = ["Qwen2MoeFamily", "Qwen3MoeFamily"]


class _MoEFamily(ModelFamily):
    config_class = MoEDecoderConfig
    lora_targets = ATTENTION_TARGETS
    qk_norm = True
    shared_expert = False

    def build(self, config: MoEDecoderConfig, rngs: nnx.Rngs) -> MoEDecoder:
        return MoEDecoder(config, rngs=rngs)

    def _attention_bias(self, hf: dict[str, Any]) -> bool:
        return False

    def _window(self, hf: dict[str, Any]) -> int | None:
        return None

    def config_from_hf(self, hf: dict[str, Any], **kwargs: Any) -> MoEDecoderConfig:
        capacity = kwargs.pop("capacity_factor", None)
        window = self._window(hf)
        plain = {**hf, "model_type": "qwen3", "use_sliding_window": False}
        if window is None:
            plain["use_sliding_window"] = hf.get("use_sliding_window", False)
        try:
            base = decoder_config_from_hf(
                plain, qk_norm=self.qk_norm, attention_bias=self._attention_bias(hf), **kwargs
            )
        except ValueError as e:  # name the model_type read, not the stand-in
            raise ValueError(str(e).replace("'qwen3'", repr(self.name))) from None
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(DecoderConfig)}
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        if experts is None:
            raise ValueError(f"from_hf_config: a {self.name!r} config.json needs num_experts")
        return MoEDecoderConfig(
            **{**fields, "family": self.name, "sliding_window": window},
            num_experts=int(experts),
            num_experts_per_tok=int(hf["num_experts_per_tok"]),
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
            shared_expert_intermediate_size=int(
                hf.get("shared_expert_intermediate_size", 0) if self.shared_expert else 0
            ),
            capacity_factor=capacity,
        )

    def check(self, config: MoEDecoderConfig) -> None:
        """Raises if `config` holds what this family's config.json cannot say."""
        if config.qk_norm != self.qk_norm or (
            bool(config.shared_expert_intermediate_size) != self.shared_expert
        ):
            raise ValueError(
                f"{self.hf_architecture} has qk_norm={self.qk_norm} and "
                f"{'a' if self.shared_expert else 'no'} shared expert; this config has "
                f"qk_norm={config.qk_norm}, shared_expert_intermediate_size="
                f"{config.shared_expert_intermediate_size}"
            )

    def config_to_hf(self, config: MoEDecoderConfig) -> dict[str, Any]:
        self.check(config)
        return {
            **decoder_hf_config(config, self.hf_architecture),
            "decoder_sparse_step": config.decoder_sparse_step,
            "moe_intermediate_size": config.moe_intermediate_size,
            "num_experts_per_tok": config.num_experts_per_tok,
            "num_experts": config.num_experts,
            "norm_topk_prob": config.norm_topk_prob,
            "output_router_logits": False,
            "router_aux_loss_coef": config.router_aux_loss_coef,
            "mlp_only_layers": list(config.mlp_only_layers),
        }

    # -- HF safetensors (called by models.io.hf_io)

    def load_hf_weights(self, config: MoEDecoderConfig, path: str) -> MoEDecoder:
        """The model of `config` with the weights of the HF directory `path`."""
        config = resolve_config(config)  # the layout below reads scan_layers
        where = _read_tensors(path)
        abstract = nnx.eval_shape(lambda: self.build(config, nnx.Rngs(0)))
        graphdef, state = nnx.split(abstract)
        adapters = {}
        if config.lora is not None:  # fresh adapters (B = 0), the base from the checkpoint
            fresh = jax.jit(lambda: nnx.state(self.build(config, nnx.Rngs(0)), _ADAPTER))()
            adapters = dict(nnx.to_flat_state(fresh))
        leaves = []
        with contextlib.ExitStack() as files:
            handles: dict[str, Any] = {}

            def get(name: str) -> np.ndarray:
                if name not in where:
                    raise KeyError(f"load_hf_checkpoint: tensor {name!r} missing from {path}")
                if where[name] not in handles:
                    handles[where[name]] = files.enter_context(
                        safe_open(where[name], framework="np")
                    )
                return handles[where[name]].get_tensor(name)

            for key, var in nnx.to_flat_state(state):
                if key in adapters:
                    leaves.append((key, adapters[key]))
                    continue
                parts = [_read(k, get, where, config) for k in _layer_keys(key, abstract)]
                arr = np.stack(parts) if _stacked(key, abstract) else parts[0]
                if arr.shape != tuple(var.shape):
                    raise ValueError(
                        f"load_hf_checkpoint: {'.'.join(map(str, key))} reads as shape "
                        f"{arr.shape} from {os.path.basename(path)}, config expects {var.shape}"
                    )
                leaves.append((key, var.replace(jnp.asarray(arr, dtype=var.dtype))))
        return nnx.merge(graphdef, nnx.from_flat_state(leaves))

    def hf_state_dict(self, model: MoEDecoder) -> dict[str, np.ndarray]:
        """HF-named numpy weights of `model` ([out, in], one tensor per expert)."""
        c, out = model.config, {}
        for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            arr = np.asarray(jax.device_get(var[...]))
            arrays = list(arr) if _stacked(key, model) else [arr]
            for layer_key, a in zip(_layer_keys(key, model), arrays, strict=True):
                if len(layer_key) > 2 and layer_key[-2] == "experts":
                    prefix = f"model.layers.{layer_key[1]}.mlp.experts"
                    for e in range(c.num_experts):
                        out[f"{prefix}.{e}.{layer_key[-1]}.weight"] = np.ascontiguousarray(a[e].T)
                    continue
                t = a.T if _transposed(layer_key, a.ndim) else a
                out[_hf_name(layer_key)] = np.ascontiguousarray(t)
        return out


def _stacked(key: tuple, model: MoEDecoder) -> bool:
    """Whether param `key` of `model` is a stack of layers (one of its `STACKS`, stacked)."""
    return model.config.scan_layers and key[0] in model.STACKS


def _layer_keys(key: tuple, model: MoEDecoder) -> list[tuple]:
    """The per-layer paths ("layers", i, ...) a param `key` of `model` holds (one per
    stacked layer: the layers `model.layer_stack` puts in its stack)."""
    if not _stacked(key, model):
        return [key]
    ids = [i for i in range(model.config.num_layers) if model.layer_stack(i) == key[0]]
    return [("layers", i, *key[1:]) for i in ids]


def _read(key: tuple, get, where, config: MoEDecoderConfig) -> np.ndarray:
    """One layer's param `key` from the checkpoint, in our layout ([in, out])."""
    if len(key) > 2 and key[-2] == "experts":
        prefix, proj = f"model.layers.{key[1]}.mlp.experts", key[-1]
        if f"{prefix}.0.{proj}.weight" in where:  # the Hub's per-expert tensors
            return np.stack(
                [get(f"{prefix}.{e}.{proj}.weight").T for e in range(config.num_experts)]
            )
        if proj == "down_proj":  # transformers' fused [E, D, F]
            return get(f"{prefix}.down_proj").transpose(0, 2, 1)
        gate_up = get(f"{prefix}.gate_up_proj")  # [E, 2F, D]
        F = gate_up.shape[1] // 2
        return (gate_up[:, :F] if proj == "gate_proj" else gate_up[:, F:]).transpose(0, 2, 1)
    arr = get(_hf_name(key))
    return arr.T if _transposed(key, arr.ndim) else arr


@register_family("qwen3_moe")
class Qwen3MoeFamily(_MoEFamily):
    hf_architecture = "Qwen3MoeForCausalLM"

    def _window(self, hf: dict[str, Any]) -> int | None:
        if hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
            return int(hf["sliding_window"])  # every layer, as Qwen3MoeModel windows
        return None

    def check(self, config: MoEDecoderConfig) -> None:
        super().check(config)
        if config.attention_bias:
            raise ValueError("Qwen3MoeForCausalLM: q/k/v-only attention biases have no form here")

    def config_to_hf(self, config: MoEDecoderConfig) -> dict[str, Any]:
        return {
            **super().config_to_hf(config),
            "use_sliding_window": config.sliding_window is not None,
            "sliding_window": config.sliding_window,
        }


@register_family("qwen2_moe")
class Qwen2MoeFamily(_MoEFamily):
    """Qwen2-MoE / Qwen1.5-MoE: Qwen2's attention (q/k/v biases), a shared expert."""

    hf_architecture = "Qwen2MoeForCausalLM"
    qk_norm = False
    shared_expert = True

    def _attention_bias(self, hf: dict[str, Any]) -> bool:
        return bool(hf.get("qkv_bias", True))

    def check(self, config: MoEDecoderConfig) -> None:
        super().check(config)
        if config.sliding_window is not None:
            raise ValueError("Qwen2MoeForCausalLM: a sliding window has no form here")

    def config_to_hf(self, config: MoEDecoderConfig) -> dict[str, Any]:
        hf = super().config_to_hf(config)
        hf["qkv_bias"] = hf.pop("attention_bias")
        if config.head_dim * config.num_heads == config.hidden_size:
            del hf["head_dim"]  # Qwen2MoeConfig has none (transformers reads one if given)
        n = config.num_layers
        return {
            **hf,
            "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
            "use_sliding_window": False,
            "sliding_window": 0,
            "max_window_layers": n,
            "layer_types": ["full_attention"] * n,
        }
