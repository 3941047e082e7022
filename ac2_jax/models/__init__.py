"""Models: the model protocol (`CausalLM`) and family registry (`register_family`), the
Flax NNX decoder (the Qwen3, Llama, Qwen2 / Qwen2.5 and Mistral families), the Gemma 3 text
decoder (`Gemma3`, family "gemma3_text"), HF and Orbax weight I/O. The tokenizer, chat
templates and tool-call parsers are `ac2_jax.text`'s (their old names here warn); the
attention and grouped-matmul kernels are in `models.kernels`."""

from ac2_jax._deprecation import deprecated_getattr, install_moved_modules
from ac2_jax.models.config import ATTENTION_BACKENDS as ATTENTION_BACKENDS
from ac2_jax.models.config import DecoderConfig
from ac2_jax.models.config import resolve_config as resolve_config
from ac2_jax.models.decoder import Decoder
from ac2_jax.models.family import FAMILIES, CausalLM, ModelFamily, build_model, register_family
from ac2_jax.models.family import config_from_hf as config_from_hf
from ac2_jax.models.gemma3 import Gemma3, Gemma3Config
from ac2_jax.models.io.hf_io import load_hf_checkpoint, save_hf_checkpoint
from ac2_jax.models.io.params_io import latest_published as latest_published
from ac2_jax.models.io.params_io import load_published, restore_params, save_params
from ac2_jax.models.io.params_io import publish_weights as publish_weights
from ac2_jax.models.kernels.attention import attention
from ac2_jax.models.kernels.attention import choose_backend as choose_backend
from ac2_jax.models.kernels.attention import dense_attention as dense_attention
from ac2_jax.models.kernels.attention_mask import AttentionMask as AttentionMask
from ac2_jax.models.kernels.blocksparse import blocksparse_attention as blocksparse_attention
from ac2_jax.models.kernels.blocksparse import (
    blocksparse_attention_with_count as blocksparse_attention_with_count,
)
from ac2_jax.models.stacking import stack_layers as stack_layers
from ac2_jax.models.stacking import to_layout as to_layout
from ac2_jax.models.stacking import unstack_layers as unstack_layers
from ac2_jax.models.stacking import with_layout as with_layout

__all__ = [
    "CausalLM",
    "ModelFamily",
    "FAMILIES",
    "register_family",
    "build_model",
    "Decoder",
    "DecoderConfig",
    "Gemma3",
    "Gemma3Config",
    "attention",
    "load_hf_checkpoint",
    "save_hf_checkpoint",
    "load_published",
    "save_params",
    "restore_params",
]

# Moved to ac2_jax.text (issue 62, step 3), for one release.
DEPRECATED = {
    "Tokenizer": "ac2_jax.text:Tokenizer",
    "ToolCallParser": "ac2_jax.text:ToolCallParser",
    "register_parser": "ac2_jax.text:register_parser",
    "parse_tool_calls": "ac2_jax.text:parse_tool_calls",
    "build_tiny_tokenizer": "ac2_jax.text.tiny_tokenizer:build_tiny_tokenizer",
}
__getattr__ = deprecated_getattr(__name__, DEPRECATED)
# Modules that moved to ac2_jax.text and ac2_jax.models.kernels: their old paths warn.
install_moved_modules(__name__)
