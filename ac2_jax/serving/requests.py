"""Reading request bodies: strict JSON and validated OpenAI requests.

`read_json` refuses what Python's `json` would let through: NaN/Infinity
(400), bodies over `max_bytes` (413), nesting deeper than `max_depth` (400)
and bytes that are not UTF-8 (400). `parse_chat_request` and
`parse_completion_request` check every field (type, range, size) before a
request reaches the sampler, and answer 400 naming the field for anything
out of range, unknown or not implemented: no field is silently ignored.

Accepted and deliberately not acted on (documented, not silent):
  user                 OpenAI's end-user id for abuse tracking. Never the agent label.
  metadata             OpenAI's stored-completion tags (strings); nothing is stored
                       for them. `metadata.agent` is refused: label agents with the
                       `X-Agent` header or the top-level `agent` extension field.
  parallel_tool_calls  every tool call the model writes is returned, whatever its
                       value: the model is not constrained to one call.

tool_choice: "auto" (default) parses tool calls from the output; "none" still
renders the tools into the prompt but parses nothing (calls stay text);
"required" and a named function force a call (see `generation`).
response_format: only {"type": "text"}; json_object and json_schema are 400s
(no constrained decoding, so JSON output could not be guaranteed).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from ac2_jax.sampling.base import INT32_MAX, MAX_STOP, MAX_STOP_CHARS
from ac2_jax.serving.errors import APIError, bad_request

MAX_BODY_BYTES = 8 << 20
MAX_JSON_DEPTH = 64
MAX_N = 64
MAX_TOP_LOGPROBS = 20
MAX_TOOLS = 128
MAX_AGENT_LEN = 128
MAX_USER_LEN = 256
SEED_RANGE = (-(2**63), 2**64 - 1)

ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")

_COMMON = {
    "model",
    "n",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "seed",
    "logprobs",
    "stream",
    "stream_options",
    "user",
    "agent",
    "metadata",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
}
CHAT_FIELDS = _COMMON | {
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "max_completion_tokens",
    "top_logprobs",
}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
# OpenAI fields this server does not implement: null is taken as absent, a value is a 400.
UNIMPLEMENTED = {
    "functions",
    "function_call",
    "store",
    "service_tier",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    "min_p",
    "repetition_penalty",
}


# ------------------------------------------------------------------------------ bodies


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON (numbers must be finite)")


def _depth(obj: Any) -> int:
    """Nesting depth of a parsed JSON value, iteratively (no recursion limit)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, d = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in (value.values() if isinstance(value, dict) else value))
    return deepest


def loads_strict(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """JSON from UTF-8 bytes; 400 for bad UTF-8, NaN/Infinity, syntax or nesting."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(
            f"Request body is not valid UTF-8 (byte {e.start})", code="invalid_encoding"
        ) from None
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        value = None
        too_deep = True
    except ValueError as e:  # JSONDecodeError is a ValueError, and so is NaN's
        raise bad_request(f"Malformed JSON in request body: {e}", code="invalid_json") from None
    else:
        too_deep = _depth(value) > max_depth
    if too_deep:
        raise bad_request(
            f"Request body nests deeper than {max_depth} levels", code="json_too_deep"
        )
    return value


async def read_json(
    request, max_bytes: int = MAX_BODY_BYTES, max_depth: int = MAX_JSON_DEPTH
) -> Any:
    """The request's body, read up to `max_bytes` (413 past it), as strict JSON."""
    too_big = APIError(
        413, f"Request body is larger than {max_bytes} bytes", code="request_too_large"
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_big
        chunks.append(chunk)
    return loads_strict(b"".join(chunks), max_depth)


# ------------------------------------------------------------------------------ requests


@dataclasses.dataclass
class GenerationRequest:
    """The sampling part shared by chat and text completions."""

    model: str
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    agent: str | None = None


@dataclasses.dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict] = dataclasses.field(default_factory=list)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None  # None/"auto", "none", "required", {function}
    forced_tool: str | None = None  # the named function of tool_choice

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@dataclasses.dataclass
class CompletionRequest(GenerationRequest):
    prompt: str | list[int] = ""


def _int(body: dict, key: str, lo: int, hi: int, default=None):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{key}' must be an integer, got {type(v).__name__}", param=key)
    if not lo <= v <= hi:
        raise bad_request(f"'{key}' must be in [{lo}, {hi}], got {v}", param=key)
    return v


def _num(body: dict, key: str, default: float, ok, what: str) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad_request(f"'{key}' must be a finite number, got {v!r}", param=key)
    if not ok(v):
        raise bad_request(f"'{key}' must be {what}, got {v!r}", param=key)
    return float(v)


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{key}' must be a boolean, got {v!r}", param=key)
    return v


def _check_fields(body: dict, allowed: set[str]) -> None:
    for key, value in body.items():
        if key in allowed:
            continue
        if key in UNIMPLEMENTED and value is None:
            continue
        what = "is not implemented by this server" if key in UNIMPLEMENTED else "is unknown"
        raise bad_request(f"Field '{key}' {what}; remove it", param=key, code="unsupported_field")
    bias = body.get("logit_bias")
    if bias is not None and (not isinstance(bias, dict) or bias):
        raise bad_request(
            "'logit_bias' is not supported (only {} or null)",
            param="logit_bias",
            code="unsupported_field",
        )
    for key in ("presence_penalty", "frequency_penalty"):
        if _num(body, key, 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]") != 0.0:
            raise bad_request(
                f"'{key}' is not supported (only 0 or null)", param=key, code="unsupported_field"
            )


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP
        or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)
    ):
        raise bad_request(
            f"'stop' must be a string or a list of up to {MAX_STOP} non-empty "
            f"strings of at most {MAX_STOP_CHARS} characters",
            param="stop",
        )
    return tuple(stop)


def _label(body: dict) -> str | None:
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or len(user) > MAX_USER_LEN):
        raise bad_request(
            f"'user' must be a string of at most {MAX_USER_LEN} characters", param="user"
        )
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise bad_request("'metadata' must be an object", param="metadata")
        if "agent" in metadata:
            raise bad_request(
                "'metadata.agent' does not label the agent; send the X-Agent "
                "header or the top-level 'agent' field",
                param="metadata.agent",
            )
    agent = body.get("agent")
    if agent is not None and (
        not isinstance(agent, str) or not agent or len(agent) > MAX_AGENT_LEN
    ):
        raise bad_request(
            f"'agent' must be a non-empty string of at most {MAX_AGENT_LEN} characters",
            param="agent",
        )
    return agent


def _parse_common(body: Any, cls, allowed: set[str]):
    if not isinstance(body, dict):
        raise bad_request(f"Request body must be a JSON object, got {type(body).__name__}")
    _check_fields(body, allowed)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required (a string naming the served model)", param="model")
    max_tokens = _int(body, "max_completion_tokens", 1, INT32_MAX)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, INT32_MAX)
    logprobs = body.get("logprobs")
    top_logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
    if cls is CompletionRequest and logprobs is not None and not isinstance(logprobs, bool):
        # Legacy completions: `logprobs` is the number of top tokens.
        top_logprobs, logprobs = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS), True
    elif logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request("'logprobs' must be a boolean", param="logprobs")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise bad_request(
                "'stream_options' is only allowed when 'stream' is true", param="stream_options"
            )
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad_request(
                "'stream_options' must be {\"include_usage\": bool}", param="stream_options"
            )
    return cls(
        model=model,
        n=_int(body, "n", 1, MAX_N, 1),
        max_tokens=max_tokens,
        temperature=_num(body, "temperature", 1.0, lambda v: 0 <= v <= 2, "in [0, 2]"),
        top_p=_num(body, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=_int(body, "top_k", -1, INT32_MAX, -1),
        stop=_stop(body),
        seed=_int(body, "seed", *SEED_RANGE),
        logprobs=bool(logprobs) or top_logprobs > 0,
        top_logprobs=top_logprobs,
        stream=stream,
        include_usage=_bool(options or {}, "include_usage"),
        agent=_label(body),
    )


def _text_content(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(
                    f"{where}.content: only text parts are supported, got {kind!r}",
                    param=f"{where}.content",
                )
        return "\n".join(parts)
    raise bad_request(
        f"{where}.content must be a string or a list of text parts", param=f"{where}.content"
    )


def normalize_messages(messages: Any) -> list[dict]:
    """Validated OpenAI messages as plain dicts with string content."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(
                f"{where}.role must be one of {list(ROLES)}, got {role!r}", param=f"{where}.role"
            )
        msg = {k: m[k] for k in _MESSAGE_KEYS if m.get(k) is not None}
        msg["role"] = "system" if role == "developer" else role
        content = _text_content(m.get("content"), where)
        if content is not None:
            msg["content"] = content
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise bad_request(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request(
                        f"{where}.tool_calls[{j}].function.name is required",
                        param=f"{where}.tool_calls",
                    )
            if content is None and not calls:
                raise bad_request(
                    f"{where}: an assistant message needs content or tool_calls",
                    param=f"{where}.content",
                )
            if calls:
                msg["tool_calls"] = calls
        elif content is None:
            raise bad_request(
                f"{where}.content is required for role {role!r}", param=f"{where}.content"
            )
        out.append(msg)
    return out


def _tool_choice(body: dict, tools: list[dict] | None) -> tuple[Any, str | None]:
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return choice, None
    names = [t["function"]["name"] for t in tools or ()]
    if choice == "required":
        forced = None
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        forced = choice["function"]["name"]
        if forced not in names:
            raise bad_request(
                f"'tool_choice' names function {forced!r}, which is not in 'tools' ({names})",
                param="tool_choice",
            )
    else:
        raise bad_request(
            "'tool_choice' must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if not names:
        raise bad_request(
            "'tool_choice' requires a tool call but 'tools' is empty", param="tool_choice"
        )
    return choice, forced


def parse_chat_request(body: Any) -> ChatRequest:
    req = _parse_common(body, ChatRequest, CHAT_FIELDS)
    req.messages = normalize_messages(body.get("messages"))
    tools = body.get("tools")
    if tools is not None:
        if (
            not isinstance(tools, list)
            or len(tools) > MAX_TOOLS
            or not all(
                isinstance(t, dict)
                and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str)
                for t in tools
            )
        ):
            raise bad_request(
                f"'tools' must be a list of up to {MAX_TOOLS} "
                "{type: function, function: {name, ...}}",
                param="tools",
            )
        req.tools = tools or None
    req.tool_choice, req.forced_tool = _tool_choice(body, req.tools)
    _bool(body, "parallel_tool_calls", True)
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind != "text":
            raise bad_request(
                f"'response_format' {kind!r} is not supported: this server has no "
                'constrained decoding (only {"type": "text"})',
                param="response_format",
                code="unsupported_field",
            )
    return req


def parse_completion_request(body: Any) -> CompletionRequest:
    req = _parse_common(body, CompletionRequest, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        req.prompt = prompt
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        req.prompt = prompt
    else:
        raise bad_request(
            "'prompt' must be a non-empty string or list of token ids "
            "(batches of several prompts are not supported)",
            param="prompt",
        )
    best_of = body.get("best_of")
    unsupported = {
        "echo": _bool(body, "echo"),
        "suffix": bool(body.get("suffix")),
        "best_of": best_of is not None and (best_of != 1 or isinstance(best_of, bool)),
    }
    for key, used in unsupported.items():
        if used:
            raise bad_request(f"'{key}' is not supported", param=key, code="unsupported_field")
    return req
