"""Request models of POST /v1/responses (the OpenAI Responses API).

The same rules as `schemas` (strict types, `extra="forbid"`, the first error a
400 naming the field: `input[2].call_id`, `tools[0].type`, `text.format`),
built from its blocks. The Responses API shares few fields with Chat
Completions (no n, stop, max_tokens, penalties), so `ResponsesBody` has its
own field list rather than subclassing `SamplingBody`; what each field does
is in `responses`' docstring.

An item, content part or tool of a kind this server does not implement is
refused at its `type` (`input[0].type`: 'reasoning' ...), whatever else it
carries: `_alone` keeps only the type of such an object, so the refusal is
the error reported, not its unknown keys.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ac2_jax.sampling.base import INT32_MAX
from ac2_jax.serving.core.schemas import (
    MAX_AGENT_LEN,
    MAX_TOOLS,
    MAX_TOP_LOGPROBS,
    MAX_USER_LEN,
    SEED_RANGE,
    UNSUPPORTED,
    Metadata,
    Temperature,
    Unimplemented,
    only_when_streaming,
    shaped,
)

KINDS = ("message", "function_call", "function_call_output")
# The fields an input item of each kind needs (every other kind-specific field is refused).
KIND_FIELDS = {
    "message": ("role", "content"),
    "function_call": ("call_id", "name", "arguments"),
    "function_call_output": ("call_id", "output"),
}
TEXT_PARTS = ("input_text", "output_text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# include values accepted: logprobs are honoured; there are never reasoning items to encrypt.
INCLUDES = (LOGPROBS_INCLUDE, "reasoning.encrypted_content")

_ITEM_REFUSALS = {
    "reasoning": "these models do not reason, and this server never returns reasoning items",
    "item_reference": "items are not looked up by id: send the item itself, or chain stored "
    "responses with previous_response_id",
}
_PART_REFUSALS = {
    "refusal": "this server never returns refusal parts; send the text as output_text",
}


def _error(kind: str, message: str) -> PydanticCustomError:
    return PydanticCustomError(kind, "{message}", {"message": message})


def _alone(data: Any, known: tuple[str, ...]) -> Any:
    """An object whose `type` is not one of `known`, cut to its type (so that the
    refusal of the type is the one error reported)."""
    if isinstance(data, dict) and "type" in data and data["type"] not in known:
        return {"type": data["type"]}
    return data


def _one_of(known: tuple, why: str, refusals: dict[str, str] | None = None) -> AfterValidator:
    """Accepts the `known` values; refuses any other, saying why (`refusals` by value)."""

    def check(value: Any) -> Any:
        if value is None or value in known:
            return value
        reason = (refusals or {}).get(value, why)
        raise _error(UNSUPPORTED, f"{json.dumps(value)} is not supported: {reason}")

    return AfterValidator(check)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# ------------------------------------------------------------------------------ input


class TextPart(_Strict):
    """input_text / output_text; annotations and logprobs (echoed from an earlier
    output) are accepted and never rendered: the template sees the text."""

    type: Annotated[
        str,
        _one_of(
            TEXT_PARTS,
            "the served model reads text only (input_text / output_text parts)",
            _PART_REFUSALS,
        ),
    ]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused_type_alone(cls, data: Any) -> Any:
        return _alone(data, TEXT_PARTS)


def _as_parts(value: Any) -> Any:
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


Parts = Annotated[list[TextPart], BeforeValidator(_as_parts)]


class InputItem(_Strict):
    """A message ({role, content} with or without "type": "message"), a
    function_call or a function_call_output. `id` and `status` (and an assistant
    message's `phase`) identify an item echoed from an output: never rendered."""

    type: Annotated[
        str | None,
        _one_of(
            KINDS,
            "this server runs no built-in tools (message, function_call and "
            "function_call_output items only)",
            _ITEM_REFUSALS,
        ),
    ] = None
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None
    role: Literal["user", "system", "developer", "assistant"] | None = Field(
        None, validate_default=True
    )
    content: Parts | None = Field(None, validate_default=True)
    call_id: Annotated[str, Field(min_length=1)] | None = Field(None, validate_default=True)
    name: Annotated[str, Field(min_length=1)] | None = Field(None, validate_default=True)
    arguments: str | None = Field(None, validate_default=True)
    output: Parts | None = Field(None, validate_default=True)
    # The namespace of a function_call's function (what this server answered it with):
    # the call renders under its function's own name, as the model was offered it.
    namespace: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused_type_alone(cls, data: Any) -> Any:
        return _alone(data, KINDS)

    @property
    def kind(self) -> str:
        return self.type or "message"

    @field_validator("namespace")
    @classmethod
    def _namespace_of_calls(cls, value: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("type") or "message"
        if value is not None and kind not in ("function_call", "function_call_output"):
            raise _error("invalid_value", f"is not a field of {kind} items")
        return value

    @field_validator("role", "content", "call_id", "name", "arguments", "output")
    @classmethod
    def _fits_kind(cls, value: Any, info: ValidationInfo) -> Any:
        if "type" not in info.data:
            return value  # the type's own error is reported
        kind = info.data["type"] or "message"
        needed = KIND_FIELDS[kind]
        if value is None and info.field_name in needed:
            raise _error("missing", f"is required in {kind} items")
        if value is not None and info.field_name not in needed:
            raise _error("invalid_value", f"is not a field of {kind} items")
        return value


def _text_input(value: Any) -> Any:
    """A string input is one user message."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


# ------------------------------------------------------------------------------ tools


class FunctionTool(_Strict):
    type: Annotated[
        str,
        _one_of(
            ("function",),
            "this server runs no built-in tools; only {'type': 'function'} tools",
            {"custom": "custom (free-form) tools are not supported; use function tools"},
        ),
    ]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    # Enforced only where the tool calls are decoded under a grammar (`responses`).
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused_type_alone(cls, data: Any) -> Any:
        return _alone(data, ("function",))

    def as_chat_tool(self) -> dict[str, Any]:
        """The tool as a Chat Completions client sends it (what the template renders)."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        if self.parameters is not None:
            fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


# Built-in tools of OpenAI's Responses API: run by OpenAI's servers, never by this one.
# The server's `builtin_tools` option leaves them out of the prompt (recorded) or refuses them.
BUILTIN_TOOLS = (
    "web_search",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "web_search_2025_08_26",
    "file_search",
    "code_interpreter",
    "computer_use_preview",
    "computer_use",
    "image_generation",
    "local_shell",
    "mcp",
    "tool_search",
)
# The tags of the `tools` union (in error locations after the item's index; left out).
TOOL_TAGS = {"tools": {"function", "namespace", "builtin"}}


class NamespaceTool(_Strict):
    """A named group of function tools (Codex 0.17x sends its multi-agent tools so).
    Its functions are offered to the model under their own names (what the client's
    calls carry, beside `namespace`); the group's description starts each one's."""

    type: Literal["namespace"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    tools: Annotated[list[FunctionTool], Field(min_length=1, max_length=MAX_TOOLS)]

    def as_chat_tools(self) -> list[dict[str, Any]]:
        out = []
        for tool in self.tools:
            chat = tool.as_chat_tool()
            if self.description:
                own = chat["function"].get("description")
                chat["function"]["description"] = self.description + ("\n\n" + own if own else "")
            out.append(chat)
        return out


class BuiltinTool(BaseModel):
    """A built-in tool (`BUILTIN_TOOLS`): only its type is read; what the server does
    with it is its `builtin_tools` option (`responses`)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


def _tool_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "namespace":
        return "namespace"
    return "builtin" if kind in BUILTIN_TOOLS else "function"  # FunctionTool refuses others


AnyTool = Annotated[
    Annotated[FunctionTool, Tag("function")]
    | Annotated[NamespaceTool, Tag("namespace")]
    | Annotated[BuiltinTool, Tag("builtin")],
    Discriminator(_tool_tag),
]


def function_tools(tools: list | None) -> list[tuple[FunctionTool, str | None]]:
    """Every function tool of `tools` with its namespace (None: top level), in order."""
    out: list[tuple[FunctionTool, str | None]] = []
    for tool in tools or ():
        if isinstance(tool, FunctionTool):
            out.append((tool, None))
        elif isinstance(tool, NamespaceTool):
            out += [(t, tool.name) for t in tool.tools]
    return out


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class Reasoning(_Strict):
    """These models do not reason: effort only null or "none"; a summary of no
    reasoning is no summary, so `summary` is accepted and changes nothing."""

    effort: (
        Annotated[
            str,
            _one_of(
                ("none",),
                "these models do not reason; send null or 'none' "
                '(Codex: model_reasoning_effort = "none")',
            ),
        ]
        | None
    ) = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(_Strict):
    type: Literal["text"]


class JsonObjectFormat(_Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(_Strict):
    type: Literal["json_schema"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(_Strict):
    format: (
        Annotated[
            dict[str, Any],
            shaped(
                TextFormat | JsonObjectFormat | JsonSchemaFormat,
                'must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                '"name": "[a-zA-Z0-9_-]{1,64}", "schema": {...}, "strict": bool, '
                '"description": str}',
            ),
        ]
        | None
    ) = None
    verbosity: (
        Annotated[
            Literal["low", "medium", "high"],
            _one_of(("medium",), "the model takes no verbosity hint ('medium' or null)"),
        ]
        | None
    ) = None


class StreamOptions(_Strict):
    include_obfuscation: (
        Annotated[bool, _one_of((False,), "the events carry no obfuscation padding")] | None
    ) = None


# ------------------------------------------------------------------------------ request


class ResponsesBody(_Strict):
    """POST /v1/responses."""

    model: str = Field(min_length=1)
    input: Annotated[list[InputItem], BeforeValidator(_text_input)] | None = None
    instructions: str | None = None
    previous_response_id: Annotated[str, Field(min_length=1)] | None = None
    tools: Annotated[list[AnyTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: (
        Annotated[
            str | dict[str, Any],
            shaped(
                Literal["auto", "none", "required"] | NamedFunction,
                "must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...} "
                "(built-in tools and allowed_tools are not supported)",
            ),
        ]
        | None
    ) = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: Temperature = None
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: (
        list[
            Annotated[
                str,
                _one_of(INCLUDES, f"this server can include only {list(INCLUDES)}"),
            ]
        ]
        | None
    ) = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None
    reasoning: Reasoning | None = None
    text: TextConfig | None = None
    truncation: (
        Annotated[
            str,
            _one_of(
                ("disabled",),
                "the prompt is never cut (only 'disabled'); a prompt past the context is a 400",
            ),
        ]
        | None
    ) = None
    service_tier: (
        Annotated[
            str,
            _one_of(("auto", "default"), "this server has one tier ('auto' or 'default')"),
        ]
        | None
    ) = None
    # Labels and tags, accepted and not acted on (see `responses`).
    metadata: Metadata | None = None
    client_metadata: dict[str, str] | None = None
    user: str | None = Field(None, max_length=MAX_USER_LEN)
    safety_identifier: str | None = Field(None, max_length=MAX_USER_LEN)
    prompt_cache_key: str | None = None
    # House extensions.
    agent: str | None = Field(None, min_length=1, max_length=MAX_AGENT_LEN)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    # OpenAI fields this server does not implement: null is taken as absent.
    background: Unimplemented = None
    conversation: Unimplemented = None
    max_tool_calls: Unimplemented = None
    prompt: Unimplemented = None
    prompt_cache_retention: Unimplemented = None
    context_management: Unimplemented = None

    _only_when_streaming = field_validator("stream_options")(only_when_streaming)

    @field_validator("tools")
    @classmethod
    def _names_once(cls, value: list | None) -> list | None:
        names = [t.name for t, _ in function_tools(value)]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise _error(
                "invalid_value",
                f"offers function(s) {twice} more than once (at the top level or in "
                "namespaces); the model sees one flat list of names, so each must be unique",
            )
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or value in ("auto", "none") or "tools" not in info.data:
            return value
        names = [t.name for t, _ in function_tools(info.data["tools"])]
        if isinstance(value, dict) and value["name"] not in names:
            raise _error(
                "invalid_value",
                f"names function {value['name']!r}, which is not in 'tools' ({names})",
            )
        if not names:
            builtin = [t.type for t in info.data["tools"] or () if isinstance(t, BuiltinTool)]
            if builtin:
                raise _error(
                    "invalid_value",
                    f"requires a tool call but 'tools' holds no function: only built-in tools "
                    f"{builtin}, which this server never offers the model; declare a function",
                )
            raise _error("invalid_value", "requires a tool call but 'tools' is empty")
        return value

    @property
    def forced_tool(self) -> str | None:
        return self.tool_choice["name"] if isinstance(self.tool_choice, dict) else None

    @property
    def logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)
