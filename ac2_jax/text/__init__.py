"""Text: the tokenizer (HF `tokenizers` + the model's Jinja2 chat template, rendered as
`transformers` renders it) and the tool-call parsers (model text -> OpenAI tool calls, a
registry of formats). No JAX: reading a model's text needs no model code.

Modules: `tokenizer` (`Tokenizer`, `choose_tool_parser`), `chat_template` (sandboxed
Jinja2), `tool_parsers` (the formats, their registry, each model type's format),
`tiny_tokenizer` (a small BPE tokenizer built offline for tests and demos; also in
`ac2_jax.testing`).
"""

from ac2_jax.text.tokenizer import Tokenizer
from ac2_jax.text.tool_parsers import ParsedText, ToolCallParser, parse_tool_calls, register_parser

__all__ = [
    "Tokenizer",
    "ToolCallParser",
    "ParsedText",
    "register_parser",
    "parse_tool_calls",
]
