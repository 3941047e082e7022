"""Tokenizer: HF `tokenizers` + the model's Jinja2 chat template, no torch.

`Tokenizer.from_pretrained(dir)` reads an HF tokenizer directory
(tokenizer.json, tokenizer_config.json, optional chat_template.jinja and
generation_config.json) and renders chat templates the way `transformers`
does (see `chat_template`), so prompts match the HF stack id for id.
Tool calls in model text are parsed by the named `tool_parsers` format;
`from_pretrained` picks it (`choose_tool_parser`): the format the chat template
renders calls in, else the model family's (config.json's model_type:
`tool_parsers.family_format`), else "hermes" (`<tool_call>\n{"name": ...,
"arguments": {...}}\n</tool_call>`); `tool_parser=` overrides it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence

import jinja2
from tokenizers import Tokenizer as HFTokenizer

from ac2_jax.text.chat_template import (
    clean_messages,
    compile_chat_template,
    render_chat,
    select_template,
)
from ac2_jax.text.tool_parsers import ParsedText, family_format, get_parser, parser_for_template

_SPECIAL_ATTRS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _token_str(value) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        return value.get("content")
    return value


class Tokenizer:
    """Text <-> ids and chat rendering for one model.

    `stop_token_ids` are the ids that end an assistant turn (the EOS token
    plus generation_config's eos ids); samplers get them as stop tokens.
    `tool_parser` names the registered tool-call format of the model's
    output (`tool_parsers.parser_names()`); the parser is `self.tool_parser`.
    """

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        chat_template: str | dict | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        extra_stop_token_ids: Iterable[int] = (),
        model_max_length: int | None = None,
        tool_parser: str = "hermes",
    ):
        self.hf = tokenizer
        self.tool_parser = get_parser(tool_parser)
        self.tool_parser_source = "asked"  # from_pretrained: how it picked the format
        self.chat_template = chat_template
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.model_max_length = model_max_length
        self._compiled: dict[str, jinja2.Template] = {}
        stops = [self.eos_token_id] if self.eos_token_id is not None else []
        stops += [int(t) for t in extra_stop_token_ids if int(t) not in stops]
        self.stop_token_ids: tuple[int, ...] = tuple(stops)

    # ---- ids -------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; added tokens written in the text become their ids."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf.id_to_token(int(token_id))

    def _special_id(self, attr: str) -> int | None:
        tok = self.special_tokens.get(attr)
        return None if tok is None else self.hf.token_to_id(tok)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def pad_token_id(self) -> int | None:
        pad = self._special_id("pad_token")
        return self.eos_token_id if pad is None else pad

    # ---- chat ------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: Sequence[dict],
        tools: Sequence[dict] | None = None,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs,
    ) -> str | list[int]:
        """Renders `messages` (OpenAI dicts) to text, or ids with tokenize=True.

        Keys whose value is None are dropped first, as transformers does.
        """
        msgs = clean_messages(messages)
        source = select_template(self.chat_template, bool(tools))
        if source not in self._compiled:
            self._compiled[source] = compile_chat_template(source)
        text = render_chat(
            self._compiled[source],
            msgs,
            tools,
            add_generation_prompt,
            **{**self.special_tokens, **kwargs},
        )
        return self.encode(text) if tokenize else text

    def set_tool_parser(self, name: str) -> None:
        """Parses tool calls in the registered format `name` from now on (an unknown
        name is a ValueError listing the registered ones)."""
        self.tool_parser = get_parser(name)
        self.tool_parser_source = "asked"

    def parse_tool_calls(self, text: str, tools: Sequence[dict] | None = None) -> ParsedText:
        """(content, OpenAI tool_calls) of model text, by `self.tool_parser`."""
        return self.tool_parser.parse(text, tools)

    # ---- files -----------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, tool_parser: str | None = None) -> Tokenizer:
        """Loads an HF tokenizer directory (no network). tool_parser: a registered
        format name; None picks it (`choose_tool_parser`; `self.tool_parser_source`
        says how it was picked)."""
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_file):
            raise FileNotFoundError(
                f"{path}: no tokenizer.json (only fast tokenizers are supported)"
            )
        hf = HFTokenizer.from_file(tok_file)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        special_map = _read_json(os.path.join(path, "special_tokens_map.json"))
        special = {a: _token_str(config.get(a, special_map.get(a))) for a in _SPECIAL_ATTRS}
        template = config.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        if isinstance(template, list):
            template = {t["name"]: t["template"] for t in template}
        gen = _read_json(os.path.join(path, "generation_config.json"))
        extra = gen.get("eos_token_id", [])
        extra = [extra] if isinstance(extra, int) else list(extra or [])
        max_len = config.get("model_max_length")
        max_len = int(max_len) if isinstance(max_len, (int, float)) and max_len < 1e12 else None
        source = "asked"
        if tool_parser is None:
            model_type = _read_json(os.path.join(path, "config.json")).get("model_type")
            tool_parser, source = choose_tool_parser(template, model_type)
        tok = cls(
            hf,
            chat_template=template,
            special_tokens=special,
            extra_stop_token_ids=extra,
            model_max_length=max_len,
            tool_parser=tool_parser,
        )
        tok.tool_parser_source = source
        return tok

    def save_pretrained(self, path: str) -> None:
        """Writes tokenizer.json + tokenizer_config.json (+ special_tokens_map)."""
        os.makedirs(path, exist_ok=True)
        self.hf.save(os.path.join(path, "tokenizer.json"))
        added = {}
        for tid, tok in sorted(self.hf.get_added_tokens_decoder().items()):
            added[str(tid)] = {
                "content": tok.content,
                "lstrip": tok.lstrip,
                "rstrip": tok.rstrip,
                "normalized": tok.normalized,
                "single_word": tok.single_word,
                "special": tok.special,
            }
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added,
            "clean_up_tokenization_spaces": False,
            "split_special_tokens": False,
            **self.special_tokens,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        _write_json(os.path.join(path, "tokenizer_config.json"), config)
        _write_json(os.path.join(path, "special_tokens_map.json"), dict(self.special_tokens))
        extra = [t for t in self.stop_token_ids if t != self.eos_token_id]
        if extra:
            _write_json(
                os.path.join(path, "generation_config.json"),
                {"eos_token_id": list(self.stop_token_ids)},
            )


def choose_tool_parser(chat_template: str | dict | None, model_type: str | None) -> tuple[str, str]:
    """(format name, why) of a model's tool calls: the format its chat template renders
    calls in (`parser_for_template`: a fine-tune's template wins over its architecture,
    e.g. Hermes-3 on Llama), else its family's (`tool_parsers.family_format` of
    config.json's model_type: the built-in families' and any registered family's
    `ModelFamily.tool_parser`), else "hermes"."""
    name = parser_for_template(chat_template)
    if name is not None:
        return name, "the chat template's format"
    family = family_format(model_type)
    if family is not None:
        return family, f"the {model_type} family's format"
    return "hermes", "the default (no tool markup in the chat template, no known family)"


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
