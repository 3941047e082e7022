"""The built-in model families: Qwen3 and Llama, both the `Decoder` of `DecoderConfig`.

They differ in the per-head q/k RMSNorm (Qwen3's `qk_norm`) and in a few
`config.json` fields. Registered in `models.family.FAMILIES` (imported on its
first lookup); a new family follows the same pattern in its own module.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from ac2_jax.models.config import DecoderConfig, decoder_config_from_hf, decoder_hf_config
from ac2_jax.models.decoder import Decoder
from ac2_jax.models.family import ModelFamily, register_family


class _DecoderFamily(ModelFamily):
    """A family whose model is `Decoder` and whose config is `DecoderConfig`."""

    config_class = DecoderConfig
    qk_norm = True

    def build(self, config: DecoderConfig, rngs: nnx.Rngs) -> Decoder:
        return Decoder(config, rngs=rngs)

    def config_from_hf(self, hf: dict[str, Any], **kwargs: Any) -> DecoderConfig:
        return decoder_config_from_hf(hf, qk_norm=self.qk_norm, **kwargs)

    def config_to_hf(self, config: DecoderConfig) -> dict[str, Any]:
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
