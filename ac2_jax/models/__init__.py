"""Models: the Flax NNX decoder (Qwen3/Llama family), HF and Orbax weight I/O."""

from ac2_jax.models.config import DecoderConfig
from ac2_jax.models.decoder import Decoder, KVCache, apply_rope, attention, rope_inv_freq
from ac2_jax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from ac2_jax.models.params_io import (latest_published, load_published, publish_weights,
                                      restore_params, save_params)
from ac2_jax.models.tokenizer import Tokenizer, build_tiny_tokenizer, parse_tool_calls

__all__ = [
    "Decoder", "DecoderConfig", "KVCache", "apply_rope", "attention", "latest_published",
    "load_hf_checkpoint", "load_published", "publish_weights", "restore_params",
    "rope_inv_freq", "save_hf_checkpoint", "save_params",
    "Tokenizer", "build_tiny_tokenizer", "parse_tool_calls",
]
