"""Models: the model protocol (`CausalLM`) and family registry (`register_family`), the
Flax NNX decoder (the Qwen3, Llama, Qwen2 / Qwen2.5 and Mistral families), the Gemma 3 text
decoder (`Gemma3`, family "gemma3_text"), HF and Orbax weight I/O, the tokenizer with its chat
templates and tool-call parsers."""

from ac2_jax.models.attention import attention, choose_backend, dense_attention
from ac2_jax.models.attention_mask import AttentionMask
from ac2_jax.models.blocksparse import blocksparse_attention, blocksparse_attention_with_count
from ac2_jax.models.chat_template import compile_chat_template
from ac2_jax.models.config import ATTENTION_BACKENDS, DecoderConfig
from ac2_jax.models.decoder import Decoder, KVCache
from ac2_jax.models.family import (
    FAMILIES,
    CausalLM,
    ModelFamily,
    build_model,
    config_from_hf,
    get_family,
    register_family,
)
from ac2_jax.models.gemma3 import Gemma3, Gemma3Config
from ac2_jax.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from ac2_jax.models.layers import apply_rope, rope_inv_freq
from ac2_jax.models.params_io import (
    latest_published,
    load_published,
    publish_weights,
    restore_params,
    save_params,
)
from ac2_jax.models.stacking import stack_layers, to_layout, unstack_layers, with_layout
from ac2_jax.models.tiny_tokenizer import build_tiny_tokenizer, tiny_corpus
from ac2_jax.models.tokenizer import Tokenizer
from ac2_jax.models.tool_parsers import (
    HermesParser,
    MistralParser,
    ParsedText,
    Qwen3CoderParser,
    ToolCallParser,
    get_parser,
    parse_tool_calls,
    parser_names,
    register_parser,
)

__all__ = [
    "Decoder",
    "DecoderConfig",
    "KVCache",
    "Gemma3",
    "Gemma3Config",
    "CausalLM",
    "FAMILIES",
    "ModelFamily",
    "build_model",
    "config_from_hf",
    "get_family",
    "register_family",
    "apply_rope",
    "attention",
    "latest_published",
    "ATTENTION_BACKENDS",
    "AttentionMask",
    "choose_backend",
    "dense_attention",
    "blocksparse_attention",
    "blocksparse_attention_with_count",
    "stack_layers",
    "unstack_layers",
    "to_layout",
    "with_layout",
    "load_hf_checkpoint",
    "load_published",
    "publish_weights",
    "restore_params",
    "rope_inv_freq",
    "save_hf_checkpoint",
    "save_params",
    "Tokenizer",
    "build_tiny_tokenizer",
    "tiny_corpus",
    "compile_chat_template",
    "ToolCallParser",
    "HermesParser",
    "MistralParser",
    "Qwen3CoderParser",
    "ParsedText",
    "register_parser",
    "get_parser",
    "parser_names",
    "parse_tool_calls",
]
