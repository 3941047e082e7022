"""Reading request bodies: strict JSON and validated OpenAI requests.

`read_json` refuses what Python's `json` would let through: NaN/Infinity
(400), bodies over `max_bytes` (413), nesting deeper than `max_depth` (400)
and bytes that are not UTF-8 (400). `parse_chat_request` and
`parse_completion_request` validate a body with the pydantic models of
`schemas` (every field: type, range, size; 400 naming the field for anything
out of range, unknown or not implemented: no field is silently ignored) and
turn it into the `ChatRequest` / `CompletionRequest` the sampling routes use.

Accepted and deliberately not acted on (documented, not silent):
  user                 OpenAI's end-user id for abuse tracking. Never the agent label.
  metadata             OpenAI's stored-completion tags; nothing is stored for them.
                       `metadata.agent` is refused: label agents with the `X-Agent`
                       header or the top-level `agent` extension field.

tool_choice: "auto" (default) parses tool calls from the output; "none" still
renders the tools into the prompt but parses nothing (calls stay text);
"required" and a named function force a call: the output is constrained to
whole calls of the tools (`structured`). parallel_tool_calls: false holds a
constrained tool-call turn to one call; otherwise (and with unconstrained
output) every call the model writes is returned.
response_format: "text" (default); "json_object" / "json_schema" constrain the
answer to a JSON object / a value of the schema (`structured`; "strict" true
or false, the answer always validates).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from ac2_jax.serving.core import schemas
from ac2_jax.serving.core.errors import APIError, bad_request
from ac2_jax.serving.core.schemas import MAX_AGENT_LEN, validate

__all__ = [
    "MAX_AGENT_LEN",
    "MAX_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "ChatRequest",
    "CompletionRequest",
    "GenerationRequest",
    "loads_strict",
    "normalize_messages",
    "parse_chat_request",
    "parse_completion_request",
    "read_json",
]

MAX_BODY_BYTES = 8 << 20
MAX_JSON_DEPTH = 64


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
    parallel_tool_calls: bool | None = None  # False: a constrained call turn holds one call
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", ...}

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@dataclasses.dataclass
class CompletionRequest(GenerationRequest):
    prompt: str | list[int] = ""


def _generation_fields(body: schemas.SamplingBody) -> dict[str, Any]:
    """The `GenerationRequest` fields of a validated body, defaults filled in."""
    return dict(
        model=body.model,
        n=1 if body.n is None else body.n,
        max_tokens=body.max_tokens,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        top_k=-1 if body.top_k is None else body.top_k,
        stop=body.stop_strings,
        seed=body.seed,
        stream=bool(body.stream),
        include_usage=body.include_usage,
        agent=body.agent,
    )


def normalize_messages(messages: Any) -> list[dict]:
    """Validated OpenAI messages as plain dicts with string content."""
    body = validate(schemas.MessagesBody, {"messages": messages})
    return [m.normalized() for m in body.messages]


def parse_chat_request(body: Any) -> ChatRequest:
    """POST /v1/chat/completions: the validated request (400 naming a bad field)."""
    req = validate(schemas.ChatCompletionBody, body)
    fields = _generation_fields(req)
    if req.max_completion_tokens is not None:  # the newer name wins
        fields["max_tokens"] = req.max_completion_tokens
    top_logprobs = req.top_logprobs or 0
    return ChatRequest(
        **fields,
        logprobs=bool(req.logprobs) or top_logprobs > 0,
        top_logprobs=top_logprobs,
        messages=[m.normalized() for m in req.messages],
        tools=req.tools or None,
        tool_choice=req.tool_choice,
        forced_tool=req.forced_tool,
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=req.response_format,
    )


def parse_completion_request(body: Any) -> CompletionRequest:
    """POST /v1/completions: the validated request (400 naming a bad field)."""
    req = validate(schemas.CompletionBody, body)
    if isinstance(req.logprobs, bool) or req.logprobs is None:
        logprobs, top_logprobs = bool(req.logprobs), 0
    else:  # legacy: the number of top tokens
        logprobs, top_logprobs = True, req.logprobs
    return CompletionRequest(
        **_generation_fields(req), logprobs=logprobs, top_logprobs=top_logprobs, prompt=req.prompt
    )
