"""Models: the Flax NNX decoder (Qwen3/Llama family), HF and Orbax weight I/O,
the tokenizer with its chat templates and tool-call parsers."""

from ac2_jax.models.chat_template import compile_chat_template
from ac2_jax.models.config import DecoderConfig
from ac2_jax.models.decoder import Decoder, KVCache, apply_rope, attention, rope_inv_freq
from ac2_jax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from ac2_jax.models.params_io import (latest_published, load_published, publish_weights,
                                      restore_params, save_params)
from ac2_jax.models.tiny_tokenizer import build_tiny_tokenizer, tiny_corpus
from ac2_jax.models.tokenizer import Tokenizer
from ac2_jax.models.tool_parsers import (HermesParser, ParsedText, Qwen3CoderParser,
                                         ToolCallParser, get_parser, parse_tool_calls,
                                         parser_names, register_parser)

__all__ = [
    "Decoder", "DecoderConfig", "KVCache", "apply_rope", "attention", "latest_published",
    "load_hf_checkpoint", "load_published", "publish_weights", "restore_params",
    "rope_inv_freq", "save_hf_checkpoint", "save_params",
    "Tokenizer", "build_tiny_tokenizer", "tiny_corpus", "compile_chat_template",
    "ToolCallParser", "HermesParser", "Qwen3CoderParser", "ParsedText", "register_parser",
    "get_parser", "parser_names", "parse_tool_calls",
]
