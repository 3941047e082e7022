"""Models: the Flax NNX decoder (Qwen3/Llama family), HF and Orbax weight I/O."""

from ac2_jax.models.config import DecoderConfig
from ac2_jax.models.decoder import Decoder, KVCache, apply_rope, attention, rope_inv_freq

__all__ = ["Decoder", "DecoderConfig", "KVCache", "apply_rope", "attention", "rope_inv_freq"]
