"""The built-in model families: Qwen3, Llama, Qwen2 / Qwen2.5 and Mistral, all the
`Decoder` of `DecoderConfig`; Gemma 3 (`gemma3_text`), in its own module
(`models.gemma3`: `Gemma3` of `Gemma3Config`), registered by importing it here;
Qwen3-MoE / Qwen2-MoE (`models.qwen3_moe`: `MoEDecoder` of `MoEDecoderConfig`),
likewise.

They differ in the per-head q/k RMSNorm (Qwen3's `qk_norm`), the q/k/v
projection biases (Qwen2's `attention_bias`), the sliding window of every
layer (Mistral's `sliding_window`) and in a few `config.json` fields.
Registered in `models.family.FAMILIES` (imported on its first lookup); a new
family follows the same pattern in its own module.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

import ac2_jax.models.qwen3_moe  # noqa: F401  (registers "qwen3_moe", "qwen2_moe")
from ac2_jax.models import gemma3  # noqa: F401  (registers "gemma3_text")
from ac2_jax.models.config import DecoderConfig, decoder_config_from_hf, decoder_hf_config
from ac2_jax.models.decoder import Decoder
from ac2_jax.models.family import ModelFamily, register_family


class _DecoderFamily(ModelFamily):
    """A family whose model is `Decoder` and whose config is `DecoderConfig`."""

    config_class = DecoderConfig
    qk_norm = True
    attention_bias = False

    def build(self, config: DecoderConfig, rngs: nnx.Rngs) -> Decoder:
        return Decoder(config, rngs=rngs)

    def config_from_hf(self, hf: dict[str, Any], **kwargs: Any) -> DecoderConfig:
        return decoder_config_from_hf(
            hf, qk_norm=self.qk_norm, attention_bias=self.attention_bias, **kwargs
        )

    def check(self, config: DecoderConfig) -> None:
        """Raises if `config` holds what this family's config.json cannot say."""
        fixed = {"qk_norm": self.qk_norm, "attention_bias": self.attention_bias}
        for name, want in fixed.items():
            if getattr(config, name) != want:
                raise ValueError(
                    f"{self.hf_architecture} has {name}={want}; this config has "
                    f"{name}={getattr(config, name)} (pick the family that has it)"
                )
        if config.sliding_window is not None:
            raise ValueError(
                f"{self.hf_architecture}: sliding_window={config.sliding_window} has no "
                "form in its config.json here; use family 'mistral' (every layer windowed)"
            )

    def config_to_hf(self, config: DecoderConfig) -> dict[str, Any]:
        self.check(config)
        return decoder_hf_config(config, self.hf_architecture)


@register_family("qwen3")
class Qwen3Family(_DecoderFamily):
    hf_architecture = "Qwen3ForCausalLM"
    qk_norm = True

    def config_to_hf(self, config: DecoderConfig) -> dict[str, Any]:
        return {
            **super().config_to_hf(config),
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": config.num_layers,
        }


@register_family("llama")
class LlamaFamily(_DecoderFamily):
    hf_architecture = "LlamaForCausalLM"
    qk_norm = False

    def config_to_hf(self, config: DecoderConfig) -> dict[str, Any]:
        return {**super().config_to_hf(config), "mlp_bias": False, "pretraining_tp": 1}


@register_family("qwen2")
class Qwen2Family(_DecoderFamily):
    """Qwen2 / Qwen2.5: Llama's layer with q/k/v biases (o has none), no qk-norm.

    Its sliding-window fields are read as transformers reads them: with
    `use_sliding_window` false (as every Qwen2.5 ships) no layer is windowed;
    a config.json that windows some layers (`max_window_layers`,
    `layer_types`) is refused with an error naming the fields.
    """

    hf_architecture = "Qwen2ForCausalLM"
    qk_norm = False
    attention_bias = True

    def config_to_hf(self, config: DecoderConfig) -> dict[str, Any]:
        hf = super().config_to_hf(config)
        del hf["attention_bias"]  # Qwen2's biases are fixed, not a config field
        if config.head_dim * config.num_heads == config.hidden_size:
            del hf["head_dim"]  # Qwen2Config has none (transformers reads one if given)
        return {
            **hf,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": config.num_layers,
        }


@register_family("mistral")
class MistralFamily(_DecoderFamily):
    """Mistral: Llama's layer with `sliding_window` (an int or null): when set,
    every layer's query at position p attends to positions > p - sliding_window."""

    hf_architecture = "MistralForCausalLM"
    qk_norm = False

    def config_from_hf(self, hf: dict[str, Any], **kwargs: Any) -> DecoderConfig:
        if hf.get("layer_types") is not None:
            raise ValueError(
                "from_hf_config: a 'mistral' config.json with layer_types (alternating "
                "sliding / full layers) is not supported; per-layer windows are "
                "another family's (transformers reads it as Ministral)"
            )
        window = hf.get("sliding_window")
        config = decoder_config_from_hf(hf, qk_norm=False, **kwargs)
        return config.replace(sliding_window=None if window is None else int(window))

    def check(self, config: DecoderConfig) -> None:
        super().check(config.replace(sliding_window=None))

    def config_to_hf(self, config: DecoderConfig) -> dict[str, Any]:
        hf = super().config_to_hf(config)
        del hf["attention_bias"]  # MistralConfig has no such field
        return {**hf, "sliding_window": config.sliding_window}
