"""The tiny tokenizer for tests and demos, built offline.

`build_tiny_tokenizer(path)` trains a small byte-level BPE tokenizer with a
Qwen-style ChatML template and Hermes tool calls on a deterministic synthetic
corpus (`tiny_corpus`) and saves it in HF format at `path`;
`transformers.AutoTokenizer` loads the saved directory.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from ac2_jax.text.tokenizer import Tokenizer

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


def _token_id(hf: HFTokenizer, token: str) -> int:
    i = hf.token_to_id(token)
    if i is None:
        raise ValueError(f"tiny tokenizer: {token!r} is not in its vocabulary")
    return int(i)


def tiny_corpus(num_lines: int = 1500, seed: int = 0) -> list[str]:
    """Deterministic synthetic text: words, digits, arithmetic, chat, tool JSON."""
    rng = random.Random(seed)
    lines = [
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 14))).capitalize() + "."
        for _ in range(num_lines // 3)
    ]
    for _ in range(num_lines // 3):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op, val = rng.choice([("+", a + b), ("-", a - b), ("*", a * b)])
        lines.append(f"What is {a} {op} {b}? The answer is {val}.")
    for _ in range(num_lines // 3):
        name = rng.choice(_TOOLS)
        args = {
            rng.choice(["a", "b", "x", "city", "query", "path"]): rng.randint(0, 99),
            rng.choice(["b", "y", "unit", "n"]): rng.choice(["c", "f", 3, "paris"]),
        }
        lines.append(
            f'<|im_start|>assistant\n<tool_call>\n{{"name": "{name}", "arguments": '
            f"{json.dumps(args)}}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n"
            f"{rng.randint(0, 9999)}\n</tool_response><|im_end|>"
        )
    lines += [
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>",
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\nHi there.<|im_end|>",
        TINY_CHAT_TEMPLATE,
        "0123456789 {}[]\":,.!?'-_/()<>=+*",
    ]
    return lines


def build_tiny_tokenizer(
    path: str,
    extra_corpus: Iterable[str] = (),
    vocab_size: int = 768,
    individual_digits: bool = False,
    digit_group: int = 0,
) -> Tokenizer:
    """Trains a byte-level BPE tokenizer offline and saves it in HF format at `path`.

    individual_digits=True splits every digit into its own token (numbers then
    tokenize the same wherever they appear, which makes copying them easy).
    digit_group=k (2 or 3) splits runs of digits left to right into chunks of up
    to k digits, as GPT-4's cl100k/o200k tokenizers do with k=3, and makes every
    chunk ("0" .. "999" with leading zeros) one token: a number of up to k digits
    is then a single token, so copying it is one attention lookup. The chunk
    tokens come on top of `vocab_size` (10 + 100 + 1,000 for k=3).
    """
    if digit_group and individual_digits:
        raise ValueError(
            "build_tiny_tokenizer: pass individual_digits=True or digit_group=k, "
            "not both (individual digits is digit_group=1)"
        )
    if digit_group not in (0, 1, 2, 3):
        raise ValueError(
            f"build_tiny_tokenizer: digit_group must be 0 (off) or 1-3 digits per "
            f"token, got {digit_group!r}"
        )
    individual_digits = individual_digits or digit_group == 1
    chunks = _digit_chunks(digit_group) if digit_group > 1 else []
    hf = HFTokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if individual_digits:
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif chunks:
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(rf"\d{{1,{digit_group}}}"), behavior="isolated"),
                byte_level,
            ]
        )
    else:
        hf.pre_tokenizer = byte_level
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size + len(chunks),
        show_progress=False,
        special_tokens=list(TINY_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Every digit chunk as a word of its own, often enough that BPE merges all of them
    # (pairs first: each appears in 20 chunks), checked below.
    hf.train_from_iterator(
        list(tiny_corpus()) + list(extra_corpus) + [" ".join(chunks)] * 50, trainer=trainer
    )
    hf.add_tokens([AddedToken(t, special=False, normalized=False) for t in TINY_TOOL_TOKENS])
    tok = Tokenizer(
        hf,
        chat_template=TINY_CHAT_TEMPLATE,
        special_tokens={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
        extra_stop_token_ids=[_token_id(hf, "<|endoftext|>")],
        model_max_length=4096,
    )
    split = [c for c in chunks if len(hf.encode(c, add_special_tokens=False).ids) != 1]
    if split:
        raise ValueError(
            f"build_tiny_tokenizer: {len(split)} digit chunks are not single "
            f"tokens (e.g. {split[:3]}): raise vocab_size (now {vocab_size})"
        )
    tok.save_pretrained(path)
    return Tokenizer.from_pretrained(path)


def _digit_chunks(k: int) -> list[str]:
    """Every string of 1..k digits ("0", "00", "000", ...)."""
    return [str(i).zfill(n) for n in range(1, k + 1) for i in range(10**n)]
