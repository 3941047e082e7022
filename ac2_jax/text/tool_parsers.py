"""Tool-call parsers: model text -> (content, OpenAI tool_calls), in linear time.

A `ToolCallParser` turns the text a model emitted into the message content
and a list of OpenAI tool calls `{"id", "type": "function", "function":
{"name", "arguments"}}` (arguments a JSON string). Parsers live in a registry
(`register_parser`, `get_parser`, `parser_names`); a `Tokenizer` names one.

Registered formats:
- "hermes" (Hermes / Qwen2.5 / Qwen3):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
- "qwen3_coder" (Qwen3-Coder XML): `<tool_call>\\n<function=NAME>\\n
  <parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`.
- "mistral" (Mistral v3+ tokenizers): `[TOOL_CALLS][{"name": ..., "arguments":
  {...}}, ...]`, the calls one JSON array after the marker; call ids are 9
  alphanumerics, the only ids Mistral's chat templates take back.
- "llama3_json" (Llama 3.1 / 3.2 / 3.3 custom tools): the whole answer is
  `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`;
  several calls separated by `;`), as the published templates render a call.
- "gemma_tool_code" (Gemma 3): its published chat template renders no tools;
  Google's function-calling guide for Gemma has the model answer a Python call
  in a fenced block: ```` ```tool_code\\nget_weather(city="Paris")\\n``` ````
  (keyword arguments of literal values).

`parser_for_template(chat_template)` names the format a chat template renders
calls in (None if it renders none); `Tokenizer.from_pretrained` picks the
template's format, else the model type's (`family_format`: `FAMILY_FORMATS`, where
each model family's `ModelFamily.tool_parser` is recorded).

Every parser scans with `str.find` from a cursor that only moves forward and
decodes each block once, so its work is linear in the text length (no
backtracking regex). `ParsedText.steps` counts that work (characters covered
by each find, strip and decode). Only the first `max_chars` characters are
parsed; the rest stays content and `ParsedText.unparsed_chars` says how much.
Parsers hold no state while parsing: one instance serves many threads.
A block that is not a well-formed call (bad JSON, no name, no closing tag)
stays in the content as text and is counted in `ParsedText.malformed`.
"""

from __future__ import annotations

import abc
import json
import math
import secrets
import threading
from collections.abc import Sequence
from typing import Any

from ac2_jax.registry import Registry

DEFAULT_MAX_CHARS = 1 << 20  # parse at most 1 MiB of model text for tool calls


class ParsedText(tuple):
    """`(content, calls)` with counters; unpacks and compares as the 2-tuple.

    Attributes: content (str, stripped), calls (list of OpenAI tool calls),
    steps (int, work done: characters scanned or decoded), malformed (int,
    blocks left as text), unparsed_chars (int, text past the length cap).
    """

    steps: int
    malformed: int
    unparsed_chars: int

    def __new__(
        cls,
        content: str,
        calls: list[dict[str, Any]],
        *,
        steps: int = 0,
        malformed: int = 0,
        unparsed_chars: int = 0,
    ) -> ParsedText:
        self = super().__new__(cls, (content, calls))
        self.steps, self.malformed, self.unparsed_chars = steps, malformed, unparsed_chars
        return self

    def __reduce__(self):  # copy and pickle keep the counters
        return (_parsed_text, (self[0], self[1], self.steps, self.malformed, self.unparsed_chars))

    @property
    def content(self) -> str:
        return self[0]

    @property
    def calls(self) -> list[dict[str, Any]]:
        return self[1]


def _parsed_text(content, calls, steps, malformed, unparsed_chars) -> ParsedText:
    return ParsedText(
        content, calls, steps=steps, malformed=malformed, unparsed_chars=unparsed_chars
    )


class _Scan:
    """Forward-only search over `text[:end]` that counts the characters it covers."""

    def __init__(self, text: str, end: int):
        self.text, self.end, self.steps = text, end, 0

    def find(self, sub: str, start: int, end: int | None = None) -> int:
        end = self.end if end is None else end
        i = self.text.find(sub, start, end)
        self.steps += (end - start) if i < 0 else (i + len(sub) - start)
        return i

    def strip(self, start: int, end: int) -> str:
        self.steps += end - start
        return self.text[start:end].strip()


def new_call(name: str, arguments: str) -> dict[str, Any]:
    """One OpenAI tool call with a fresh id."""
    return {
        "id": "call_" + secrets.token_hex(12),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


class ToolCallParser(abc.ABC):
    """One tool-call format.

    `opening` is the text that starts a call; a server forces a call by
    prefilling it into the assistant turn (`named_opening(name)` forces one
    function). Blocks are `block_open ... block_close`; subclasses decode a
    block's stripped body with `parse_block`.
    """

    name: str
    opening: str
    block_open: str = "<tool_call>"
    block_close: str = "</tool_call>"

    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS):
        if not isinstance(max_chars, int) or max_chars < 0:
            raise ValueError(f"max_chars must be an int >= 0, got {max_chars!r}")
        self.max_chars = max_chars

    @abc.abstractmethod
    def named_opening(self, function_name: str) -> str:
        """The text that starts a call of `function_name`."""

    @abc.abstractmethod
    def parse_block(self, body: str, schema: Any) -> dict[str, Any] | None:
        """One call from a block body (stripped), or None if malformed.

        Must be a constant number of forward passes over `body` (linear).
        """

    def schema(self, tools: Sequence[dict] | None) -> Any:
        """What `parse_block` needs of the request's tools, built once per parse."""
        return None

    def parse(self, text: str, tools: Sequence[dict] | None = None) -> ParsedText:
        """Splits `text` into (content, tool calls); see the module docstring.

        Well-formed blocks become calls and leave the content; the content
        is stripped when calls were found and `text.strip()` otherwise.
        `tools` (OpenAI tool dicts) lets a format type its arguments.
        """
        if not isinstance(text, str):
            raise TypeError(f"parse: text must be str, got {type(text).__name__}")
        end = min(len(text), self.max_chars)
        scan = _Scan(text, end)
        schema = self.schema(tools)
        kept: list[str] = []
        calls: list[dict[str, Any]] = []
        malformed, pos = 0, 0
        while pos < end:
            start = scan.find(self.block_open, pos)
            if start < 0:
                break
            body_at = start + len(self.block_open)
            stop = scan.find(self.block_close, body_at)
            if stop < 0:  # no closing tag anywhere after: no later block can close either
                malformed += 1
                break
            after = stop + len(self.block_close)
            body = scan.strip(body_at, stop)
            scan.steps += len(body)  # decoding the body is linear in it
            call = self.parse_block(body, schema)
            kept.append(text[pos:start])
            if call is None:
                malformed += 1
                kept.append(text[start:after])
            else:
                calls.append(call)
            pos = after
        if not calls:
            return ParsedText(
                text.strip(),
                [],
                steps=scan.steps,
                malformed=malformed,
                unparsed_chars=len(text) - end,
            )
        kept.append(text[pos:])
        return ParsedText(
            "".join(kept).strip(),
            calls,
            steps=scan.steps,
            malformed=malformed,
            unparsed_chars=len(text) - end,
        )


_FAILED = object()


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _loads(s: str, allow_nan: bool = True) -> Any:
    """json.loads, or _FAILED (bad JSON, nesting too deep, ints past the digit limit;
    NaN/Infinity unless allow_nan)."""
    try:
        return json.loads(s) if allow_nan else json.loads(s, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return _FAILED


class HermesParser(ToolCallParser):
    """`<tool_call>{"name": str, "arguments": {...} | str}</tool_call>` (Hermes, Qwen).

    "parameters" is accepted for "arguments"; a missing one means `{}`.
    """

    name = "hermes"
    opening = "<tool_call>\n"

    def named_opening(self, function_name: str) -> str:
        return (
            self.opening
            + '{"name": '
            + json.dumps(function_name, ensure_ascii=False)
            + ', "arguments": '
        )

    def parse_block(self, body, schema):
        obj = _loads(body)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        return new_call(obj["name"], args)


def _schema_types(tools: Sequence[dict] | None) -> dict[str, dict[str, str]]:
    """{function name: {parameter: JSON-schema type}} from OpenAI tool dicts."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, dict) else None
        out[fn["name"]] = {
            k: str(v.get("type", "string")).lower()
            for k, v in (props if isinstance(props, dict) else {}).items()
            if isinstance(v, dict)
        }
    return out


def _typed(value: str, kind: str | None) -> Any:
    """A Qwen3-Coder parameter value typed by its JSON-schema type (vLLM's rules)."""
    if value.lower() == "null":
        return None
    if kind in (None, "string"):
        return value
    if kind == "integer":
        try:
            return int(value)
        except ValueError:
            return value
    if kind == "number":
        try:
            f = float(value)
        except ValueError:
            return value
        if not math.isfinite(f):  # nan/inf have no JSON form
            return value
        return int(f) if f.is_integer() else f
    if kind == "boolean":
        return {"true": True, "false": False}.get(value.lower(), value)
    obj = _loads(value, allow_nan=False)  # object, array, or another type JSON can read
    want = {"object": dict, "array": list}.get(kind, object)
    return obj if obj is not _FAILED and isinstance(obj, want) else value


class Qwen3CoderParser(ToolCallParser):
    """Qwen3-Coder XML: `<tool_call><function=NAME><parameter=K>V</parameter>...
    </function></tool_call>`, whitespace between tags allowed.

    One leading and one trailing newline of a value are dropped. Values are
    strings unless `tools` gives the parameter a JSON-schema type (integer,
    number, boolean, object, array; other types: any strict JSON); "null" is
    None; a value that does not read as its type (no NaN/Infinity) stays a
    string, and the tool then reports it.
    """

    name = "qwen3_coder"
    opening = "<tool_call>\n<function="

    def named_opening(self, function_name: str) -> str:
        return self.opening + function_name + ">\n"

    def schema(self, tools):
        return _schema_types(tools)

    def parse_block(self, body, schema):
        if not body.startswith("<function=") or not body.endswith("</function>"):
            return None
        inner_end = len(body) - len("</function>")
        gt = body.find(">", len("<function="), inner_end)
        if gt < 0:
            return None
        name = body[len("<function=") : gt].strip()
        if not name or "<" in name:
            return None
        types = schema.get(name, {})
        args: dict[str, Any] = {}
        pos = gt + 1
        while True:
            nxt = body.find("<", pos, inner_end)
            if nxt < 0:
                if body[pos:inner_end].strip():
                    return None  # text outside a parameter
                break
            if body[pos:nxt].strip() or not body.startswith("<parameter=", nxt):
                return None
            key_at = nxt + len("<parameter=")
            gt = body.find(">", key_at, inner_end)
            if gt < 0:
                return None
            key = body[key_at:gt].strip()
            close = body.find("</parameter>", gt + 1, inner_end)
            if not key or "<" in key or close < 0 or key in args:
                return None
            value = body[gt + 1 : close]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            args[key] = _typed(value, types.get(key))
            pos = close + len("</parameter>")
        return new_call(name, json.dumps(args, ensure_ascii=False))


_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


class MistralParser(ToolCallParser):
    """`[TOOL_CALLS][{"name": str, "arguments": {...}}, ...]` (Mistral v3+ tokenizers).

    The array is decoded once from the marker (`json.JSONDecoder.raw_decode`,
    linear in what it reads); text after it stays content. A marker not followed
    by a well-formed array ends parsing: it and the rest stay text (so no text
    is decoded twice). Ids are 9 alphanumerics, as Mistral's templates require.
    """

    name = "mistral"
    opening = block_open = "[TOOL_CALLS]"
    _decoder = json.JSONDecoder()

    def named_opening(self, function_name: str) -> str:
        name = json.dumps(function_name, ensure_ascii=False)
        return self.opening + '[{"name": ' + name + ', "arguments": '

    def parse_block(self, body, schema):
        obj = _loads(body) if isinstance(body, str) else body
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", {})
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        call = new_call(obj["name"], args)
        call["id"] = "".join(secrets.choice(_ALNUM) for _ in range(9))
        return call

    def parse(self, text: str, tools: Sequence[dict] | None = None) -> ParsedText:
        if not isinstance(text, str):
            raise TypeError(f"parse: text must be str, got {type(text).__name__}")
        end = min(len(text), self.max_chars)
        scan = _Scan(text, end)
        kept: list[str] = []
        calls: list[dict[str, Any]] = []
        malformed, pos = 0, 0
        while pos < end:
            start = scan.find(self.block_open, pos)
            if start < 0:
                break
            at = start + len(self.block_open)
            while at < end and text[at].isspace():
                at += 1
            try:  # reads text in place; past `end` only once, as it then stops
                arr, after = self._decoder.raw_decode(text, at)
            except (ValueError, RecursionError):
                arr, after = None, end
            scan.steps += after - start
            block = [self.parse_block(o, None) for o in arr] if isinstance(arr, list) else []
            if after > end or not block or None in block:
                malformed += 1
                break
            kept.append(text[pos:start])
            calls.extend(block)
            pos = after
        kept.append(text[pos:])
        content = "".join(kept).strip() if calls else text.strip()
        return ParsedText(
            content, calls, steps=scan.steps, malformed=malformed, unparsed_chars=len(text) - end
        )


class Llama3JsonParser(ToolCallParser):
    """Llama 3.x custom tool calls: the answer is `{"name": str, "parameters": {...}}`
    (or "arguments"), optionally after `<|python_tag|>`, several separated by `;`.

    Only an answer that starts with a call (after whitespace and the tag) holds
    calls, as the template renders one; otherwise it is all content. Each object
    is decoded once in place (`raw_decode`); an answer that starts like a call but
    is not a well-formed sequence of calls stays text and counts as malformed.
    """

    name = "llama3_json"
    opening = block_open = "{"
    python_tag = "<|python_tag|>"
    _decoder = json.JSONDecoder()

    def named_opening(self, function_name: str) -> str:
        return '{"name": ' + json.dumps(function_name, ensure_ascii=False) + ', "parameters": '

    def parse_block(self, body, schema):
        obj = _loads(body) if isinstance(body, str) else body
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("parameters", obj.get("arguments", {}))
        if not isinstance(args, (dict, str)):
            return None
        args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return new_call(obj["name"], args)

    def parse(self, text: str, tools: Sequence[dict] | None = None) -> ParsedText:
        if not isinstance(text, str):
            raise TypeError(f"parse: text must be str, got {type(text).__name__}")
        end = min(len(text), self.max_chars)
        at = len(text) - len(text.lstrip())
        if text.startswith(self.python_tag, at):
            at += len(self.python_tag)
        while at < end and text[at].isspace():
            at += 1
        if at >= end or text[at] != "{":
            return ParsedText(text.strip(), [], steps=at, unparsed_chars=len(text) - end)
        calls: list[dict[str, Any]] = []
        pos = at
        while True:
            try:  # reads in place; past `end` only once, as it then stops
                obj, after = self._decoder.raw_decode(text, pos)
            except (ValueError, RecursionError):
                obj, after = None, end + 1
            call = self.parse_block(obj, None) if after <= end else None
            if call is None:
                return ParsedText(text.strip(), [], steps=min(after, end), malformed=1,
                                  unparsed_chars=len(text) - end)  # fmt: skip
            calls.append(call)
            pos = after
            while pos < end and text[pos].isspace():
                pos += 1
            if pos < end and text[pos] == ";":
                pos += 1
                while pos < end and text[pos].isspace():
                    pos += 1
                if pos < end and text[pos] == "{":
                    continue
            break
        return ParsedText(text[pos:].strip(), calls, steps=pos, unparsed_chars=len(text) - end)


def _literal(node: Any) -> Any:
    """The value of a literal AST node (str, number, bool, None, list, dict), else
    raises ValueError."""
    import ast

    return ast.literal_eval(node)


class GemmaToolCodeParser(ToolCallParser):
    """Gemma 3 (Google's function-calling guide): ```` ```tool_code\\nNAME(k=v, ...)\\n``` ````,
    one Python call per block, keyword arguments of literal values (strings, numbers,
    booleans, None, lists, dicts). Anything else in a block (positional arguments,
    expressions, several statements) leaves it as text, counted as malformed.
    """

    name = "gemma_tool_code"
    opening = "```tool_code\n"
    block_open = "```tool_code"
    block_close = "```"

    def named_opening(self, function_name: str) -> str:
        return self.opening + function_name + "("

    def parse_block(self, body, schema):
        import ast

        try:
            tree = ast.parse(body, mode="eval")
        except (SyntaxError, ValueError, RecursionError):
            return None
        call = tree.body
        if not isinstance(call, ast.Call) or call.args:
            return None
        func = call.func
        parts = []
        while isinstance(func, ast.Attribute):
            parts.append(func.attr)
            func = func.value
        if not isinstance(func, ast.Name):
            return None
        name = ".".join([func.id, *reversed(parts)])
        args: dict[str, Any] = {}
        for kw in call.keywords:
            if kw.arg is None or kw.arg in args:
                return None
            try:
                args[kw.arg] = _literal(kw.value)
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None
        try:
            return new_call(name, json.dumps(args, ensure_ascii=False, allow_nan=False))
        except (TypeError, ValueError):  # a set, bytes, complex, NaN: no JSON form
            return None


PARSERS: Registry[ToolCallParser] = Registry("tool parser")
_LOCK = threading.Lock()


def register_parser(name: str, parser: ToolCallParser) -> None:
    """Adds `parser` under `name`; a taken name is an error."""
    if not isinstance(parser, ToolCallParser):
        raise TypeError(
            f"register_parser({name!r}): expected a ToolCallParser, got {type(parser).__name__}"
        )
    with _LOCK:
        if name in PARSERS:
            raise ValueError(f"tool parser {name!r} is already registered")
        PARSERS.register(name)(parser)


def get_parser(name: str) -> ToolCallParser:
    """The parser registered as `name`; an unknown name lists the known ones."""
    return PARSERS.get(name)


def parser_names() -> list[str]:
    return list(PARSERS.names())


register_parser(HermesParser.name, HermesParser())
register_parser(Qwen3CoderParser.name, Qwen3CoderParser())
register_parser(MistralParser.name, MistralParser())
register_parser(Llama3JsonParser.name, Llama3JsonParser())
register_parser(GemmaToolCodeParser.name, GemmaToolCodeParser())

# What a chat template renders a call with, per format; the first found names it
# (Qwen3-Coder's XML before Hermes: both use <tool_call>).
TEMPLATE_MARKERS = (
    ("qwen3_coder", "<function="),
    ("mistral", "[TOOL_CALLS]"),
    ("hermes", "<tool_call>"),
    ("llama3_json", '"parameters": '),
    ("gemma_tool_code", "tool_code"),
)


def parser_for_template(chat_template: str | dict | None) -> str | None:
    """The registered format a chat template renders tool calls in (by the markup it
    writes: `TEMPLATE_MARKERS`), or None when it renders none (e.g. Gemma 3's)."""
    if isinstance(chat_template, dict):
        chat_template = chat_template.get("tool_use") or chat_template.get("default")
    if not isinstance(chat_template, str):
        return None
    for name, marker in TEMPLATE_MARKERS:
        if marker in chat_template:
            return name
    return None


# The tool-call format of each model type's published chat templates (config.json's
# `model_type`), for a tokenizer whose template renders no call markup. It is text, so it
# lives here: reading a tokenizer directory needs no model code. The built-in model
# families' entries are below; a family registered with `models.register_family` that
# names its own format (`ModelFamily.tool_parser`) is recorded by `register_family_format`.
FAMILY_FORMATS: dict[str, str] = {
    "qwen3": "hermes",
    "qwen2": "hermes",
    "qwen3_moe": "hermes",
    "qwen2_moe": "hermes",
    "llama": "llama3_json",  # Llama 3.1-3.3: {"name": ..., "parameters": {...}}
    "mistral": "mistral",  # [TOOL_CALLS] [...]
    # Gemma 3's published template renders no tools; Google's function-calling guide has
    # the model answer ```tool_code\nNAME(k=v)\n```.
    "gemma3_text": "gemma_tool_code",
}


def register_family_format(model_type: str, name: str) -> None:
    """Records `name` (a registered format; an unknown one is a ValueError listing them)
    as the tool-call format of HF model_type `model_type`, replacing any earlier entry."""
    get_parser(name)
    with _LOCK:
        FAMILY_FORMATS[model_type] = name


def family_format(model_type: str | None) -> str | None:
    """The tool-call format recorded for `model_type` (`FAMILY_FORMATS`), None if none."""
    return FAMILY_FORMATS.get(model_type) if model_type else None


def parse_tool_calls(text: str, tools: Sequence[dict] | None = None) -> ParsedText:
    """`get_parser("hermes").parse(text, tools)`."""
    return PARSERS.get("hermes").parse(text, tools)
