"""Tokenizer: HF `tokenizers` + the model's Jinja2 chat template, no torch.

`Tokenizer.from_pretrained(dir)` reads an HF tokenizer directory
(tokenizer.json, tokenizer_config.json, optional chat_template.jinja and
generation_config.json) and renders chat templates the way `transformers`
does (sandboxed Jinja2, trim_blocks, lstrip_blocks, its `tojson`, special
tokens as template variables), so prompts match the HF stack id for id.

`build_tiny_tokenizer(path)` makes a small byte-level BPE tokenizer with a
Qwen-style chat/tool template from a built-in synthetic corpus, offline, for
tests and demos; `transformers.AutoTokenizer` loads the saved directory.

Tool calls use the Qwen/Hermes format:
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
from datetime import datetime
from typing import Any, Iterable, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

_SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override: no HTML escaping, json.dumps options exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def compile_chat_template(template: str) -> jinja2.Template:
    """Compiles a chat template in the environment transformers uses."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _token_str(value) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        return value.get("content")
    return value


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Splits model text into (content, OpenAI tool_calls).

    Every well-formed `<tool_call>{"name", "arguments"}</tool_call>` block
    becomes `{"id", "type": "function", "function": {"name", "arguments"}}`
    (arguments as a JSON string) and is removed from the content; malformed
    blocks stay in the content as text. Content is stripped.
    """
    calls: list[dict[str, Any]] = []

    def take(match: re.Match) -> str:
        try:
            obj = json.loads(match.group(1))
        except json.JSONDecodeError:
            return match.group(0)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return match.group(0)
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        calls.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                      "function": {"name": obj["name"], "arguments": args}})
        return ""

    content = _TOOL_CALL_RE.sub(take, text)
    return (content.strip() if calls else text.strip()), calls


class Tokenizer:
    """Text <-> ids and chat rendering for one model.

    `stop_token_ids` are the ids that end an assistant turn (the EOS token
    plus generation_config's eos ids); samplers get them as stop tokens.
    """

    def __init__(self, tokenizer: HFTokenizer, *, chat_template: str | dict | None = None,
                 special_tokens: dict[str, str] | None = None,
                 extra_stop_token_ids: Iterable[int] = (), model_max_length: int | None = None):
        self.hf = tokenizer
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
    def _template_source(self, tools) -> str:
        t = self.chat_template
        if isinstance(t, dict):  # named templates, chosen like transformers does
            if tools and "tool_use" in t:
                return t["tool_use"]
            if "default" in t:
                return t["default"]
            raise ValueError(f"chat_template has no 'default' entry (names: {sorted(t)})")
        if not t:
            raise ValueError("this tokenizer has no chat_template")
        return t

    def apply_chat_template(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **kwargs) -> str | list[int]:
        """Renders `messages` (OpenAI dicts) to text, or ids with tokenize=True.

        Keys whose value is None are dropped first, as transformers does.
        """
        if not messages:
            raise ValueError("apply_chat_template: messages is empty")
        msgs = []
        for m in messages:
            if not isinstance(m, dict):
                raise TypeError(f"chat messages must be dicts, got {type(m).__name__}")
            msgs.append({k: v for k, v in m.items() if v is not None})
        source = self._template_source(tools)
        if source not in self._compiled:
            self._compiled[source] = compile_chat_template(source)
        variables = {**self.special_tokens, **kwargs}
        text = self._compiled[source].render(
            messages=msgs, tools=list(tools) if tools else None, documents=None,
            add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text) if tokenize else text

    def parse_tool_calls(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        return parse_tool_calls(text)

    # ---- files -----------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str) -> "Tokenizer":
        """Loads an HF tokenizer directory (no network)."""
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_file):
            raise FileNotFoundError(f"{path}: no tokenizer.json (only fast tokenizers are supported)")
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
        return cls(hf, chat_template=template, special_tokens=special,
                   extra_stop_token_ids=extra, model_max_length=max_len)

    def save_pretrained(self, path: str) -> None:
        """Writes tokenizer.json + tokenizer_config.json (+ special_tokens_map)."""
        os.makedirs(path, exist_ok=True)
        self.hf.save(os.path.join(path, "tokenizer.json"))
        added = {}
        for tid, tok in sorted(self.hf.get_added_tokens_decoder().items()):
            added[str(tid)] = {"content": tok.content, "lstrip": tok.lstrip, "rstrip": tok.rstrip,
                               "normalized": tok.normalized, "single_word": tok.single_word,
                               "special": tok.special}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added,
                  "clean_up_tokenization_spaces": False, "split_special_tokens": False,
                  **self.special_tokens}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        if self.model_max_length is not None:
            config["model_max_length"] = self.model_max_length
        _write_json(os.path.join(path, "tokenizer_config.json"), config)
        _write_json(os.path.join(path, "special_tokens_map.json"), dict(self.special_tokens))
        extra = [t for t in self.stop_token_ids if t != self.eos_token_id]
        if extra:
            _write_json(os.path.join(path, "generation_config.json"),
                        {"eos_token_id": list(self.stop_token_ids)})


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


# ---------------------------------------------------------------------------
# Tiny tokenizer for tests and demos.

TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

# Qwen-style ChatML with Hermes tool calls; assistant turns render exactly as
# the generation prompt followed by what the model emits.
TINY_CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call functions. Signatures are in <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nTo call a function, return JSON with its name and arguments in \
<tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": \
<args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role in ['user', 'system'] %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- if message.content or not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{\"name\": \"' + fn.name + '\", \"arguments\": ' }}
{%- if fn.arguments is string %}{{- fn.arguments }}{%- else %}{{- fn.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- raise_exception('unknown message role: ' + message.role) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

_WORDS = (
    "the a an of to in is it you that he she they we was for on are with as his her at be "
    "this have from or one had by word but not what all were when your can said there use "
    "each which do how their if will up other about out many then them these so some would "
    "make like him into time has look two more write go see number no way could people my "
    "than first water been call who oil its now find long down day did get come made may part "
    "hello please thanks sure here answer question result total sum add subtract multiply "
    "divide compute calculate weather city temperature search file read list open tool call "
    "user assistant system function arguments name value true false null done error ok yes"
).split()
_TOOLS = ("add", "multiply", "subtract", "get_weather", "search", "read_file", "lookup")


def tiny_corpus(num_lines: int = 1500, seed: int = 0) -> list[str]:
    """Deterministic synthetic text: words, digits, arithmetic, chat, tool JSON."""
    rng = random.Random(seed)
    lines = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))).capitalize() + "."
             for _ in range(num_lines // 3)]
    for _ in range(num_lines // 3):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op, val = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
        lines.append(f"What is {a} {op} {b}? The answer is {val}.")
    for _ in range(num_lines // 3):
        name = rng.choice(_TOOLS)
        args = {rng.choice(["a", "b", "x", "city", "query", "path"]): rng.randint(0, 99),
                rng.choice(["b", "y", "unit", "n"]): rng.choice(["c", "f", 3, "paris"])}
        lines.append('<|im_start|>assistant\n<tool_call>\n{"name": "%s", "arguments": %s}\n'
                     '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n%s\n'
                     '</tool_response><|im_end|>' % (name, json.dumps(args), rng.randint(0, 9999)))
    lines += ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>",
              "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\nHi there.<|im_end|>",
              TINY_CHAT_TEMPLATE, "0123456789 {}[]\":,.!?'-_/()<>=+*"]
    return lines


def build_tiny_tokenizer(path: str, extra_corpus: Iterable[str] = (), vocab_size: int = 768,
                         individual_digits: bool = False) -> Tokenizer:
    """Trains a byte-level BPE tokenizer offline and saves it in HF format at `path`.

    individual_digits=True splits every digit into its own token (numbers then
    tokenize the same wherever they appear, which makes copying them easy).
    """
    hf = HFTokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 byte_level])
                        if individual_digits else byte_level)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=list(TINY_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(list(tiny_corpus()) + list(extra_corpus), trainer=trainer)
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in TINY_TOOL_TOKENS])
    tok = Tokenizer(hf, chat_template=TINY_CHAT_TEMPLATE,
                    special_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
                    extra_stop_token_ids=[hf.token_to_id("<|endoftext|>")],
                    model_max_length=4096)
    tok.save_pretrained(path)
    return Tokenizer.from_pretrained(path)
