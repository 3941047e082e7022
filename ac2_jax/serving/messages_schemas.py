"""Anthropic Messages request bodies, validated, and their OpenAI chat form.

`CreateBody` (POST /v1/messages) and `PromptBody` (POST
/v1/messages/count_tokens: the fields that shape the prompt) are pydantic
models in the house style of `schemas` (strict, `extra="forbid"`, 400 naming
the field; `messages.validate` reads a body with them). Content blocks,
messages and tools are tagged unions (unknown tags go to a member that
refuses them by name). Which fields are honoured, accepted as no-ops or
refused is listed in `messages`.

`PromptBody.chat_messages()` / `.chat_tools()` are what an OpenAI Chat
Completions client would send for the same conversation: the system prompt
becomes a system message; text blocks are text parts (one string, joined
with "\\n", once normalized); an assistant's tool_use blocks are its
`tool_calls` (arguments: the input as JSON); a user's tool_result blocks
become `tool` messages, in order, before a user message with its text
blocks; a tool is `{type: function, function: {name, description,
parameters: input_schema}}`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    Tag,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from ac2_jax.sampling.base import INT32_MAX, MAX_STOP, TEMPERATURE_RANGE
from ac2_jax.serving.schemas import (
    MAX_AGENT_LEN,
    MAX_TOOLS,
    MAX_USER_LEN,
    SEED_RANGE,
    UNSUPPORTED,
    StopText,
    refuse,
)

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"
TOOL_ERROR_PREFIX = "Error: "  # what a tool_result with is_error true starts with
TEXT_ONLY = "this server serves a text-only model; send the content as text"
# The tags of the tagged-union lists, by the list's field name (in error locations
# after the item's index: `messages.validate` leaves them out).
UNION_TAGS = {
    "messages": {"user", "assistant", "other"},
    "content": {"text", "tool_use", "tool_result", "image", "document", "other"},
    "tools": {"custom", "other"},
}


def _error(kind: str, message: str) -> PydanticCustomError:
    return PydanticCustomError(kind, "{message}", {"message": message})


# ------------------------------------------------------------------------------ blocks


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Refused(BaseModel):
    """A block or tool refused whole: only the refusing field is read."""

    model_config = ConfigDict(extra="ignore", strict=True)


class CacheControl(_Strict):
    """A prompt-cache breakpoint: accepted, a no-op (the prefix cache is automatic)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Annotated[
        Any,
        refuse("are not supported (only null)", kind=UNSUPPORTED, allow_null=True),
    ] = None


class DirectCaller(_Strict):
    """The model called the tool itself (the only caller here): accepted, a no-op."""

    type: Literal["direct"]


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: DirectCaller | None = None
    toolset_name: Annotated[
        Any, refuse("is not supported: MCP toolsets (only null)", kind=UNSUPPORTED, allow_null=True)
    ] = None

    def tool_call(self) -> dict[str, Any]:
        arguments = json.dumps(self.input, ensure_ascii=False)
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }


class MediaBlock(_Refused):
    """An image or document block: refused at its `source`."""

    source: Annotated[
        Any,
        refuse(
            f"is refused: image and document blocks are not supported ({TEXT_ONLY})",
            kind=UNSUPPORTED,
        ),
    ] = Field(None, validate_default=True)


def _unknown(where: str, allowed: str) -> PlainValidator:
    """The `type` of a block this place does not take: a 400 saying what it does take."""

    def check(value: Any) -> Any:
        why = ""
        if value in ("thinking", "redacted_thinking"):
            why = " (extended thinking is off on this server)"
        raise _error(UNSUPPORTED, f"is {value!r}, which {where} do not take (only {allowed}){why}")

    return PlainValidator(check)


class UserOther(_Refused):
    type: Annotated[Any, _unknown("user messages", "text and tool_result")]


class AssistantOther(_Refused):
    type: Annotated[Any, _unknown("assistant messages", "text and tool_use")]


class ResultOther(_Refused):
    type: Annotated[Any, _unknown("tool results", "text")]


def _union(key: str, known: tuple[str, ...], expected: str, default: str | None = None):
    """A tagged union's discriminator: the member tagged `value[key]` if known, else the
    one tagged "other" (which refuses it); "`expected`" for what is no object at all."""

    def tag(value: Any) -> str | None:
        if not isinstance(value, dict):
            return None
        kind = value.get(key, default)
        return kind if kind in known else "other"

    return Discriminator(tag, custom_error_type="invalid_value", custom_error_message=expected)


def _as_blocks(value: Any) -> Any:
    """A string is shorthand for one text block."""
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


def _by_type(*known: str) -> Discriminator:
    return _union("type", known, "must be a content block: an object with a 'type'")


ResultBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[MediaBlock, Tag("image")]
    | Annotated[MediaBlock, Tag("document")]
    | Annotated[ResultOther, Tag("other")],
    _by_type("text", "image", "document"),
]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Annotated[list[ResultBlock], BeforeValidator(_as_blocks)] = Field(default_factory=list)
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def tool_message(self) -> dict[str, Any]:
        text = "\n".join(b.text for b in self.content if isinstance(b, TextBlock))
        if self.is_error:
            text = TOOL_ERROR_PREFIX + text
        return {"role": "tool", "tool_call_id": self.tool_use_id, "content": text}


UserBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[MediaBlock, Tag("image")]
    | Annotated[MediaBlock, Tag("document")]
    | Annotated[UserOther, Tag("other")],
    _by_type("text", "tool_result", "image", "document"),
]
AssistantBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[AssistantOther, Tag("other")],
    _by_type("text", "tool_use"),
]


def _text_parts(blocks: list) -> list[dict[str, str]]:
    return [{"type": "text", "text": b.text} for b in blocks if isinstance(b, TextBlock)]


# ------------------------------------------------------------------------------ messages


class UserMessage(_Strict):
    role: Literal["user"]
    content: Annotated[list[UserBlock], Field(min_length=1), BeforeValidator(_as_blocks)]

    def chat_messages(self) -> list[dict[str, Any]]:
        out = [b.tool_message() for b in self.content if isinstance(b, ToolResultBlock)]
        texts = _text_parts(self.content)
        if texts:
            out.append({"role": "user", "content": texts})
        return out


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: Annotated[list[AssistantBlock], Field(min_length=1), BeforeValidator(_as_blocks)]

    def chat_messages(self) -> list[dict[str, Any]]:
        texts = _text_parts(self.content)
        calls = [b.tool_call() for b in self.content if isinstance(b, ToolUseBlock)]
        msg: dict[str, Any] = {"role": "assistant", "content": texts or None}
        if calls:
            msg["tool_calls"] = calls
        return [msg]


def _bad_role(value: Any) -> Any:
    where = " (the system prompt goes in the top-level 'system' field)" if value == "system" else ""
    raise _error("invalid_value", f"must be 'user' or 'assistant', got {value!r}{where}")


class OtherMessage(_Refused):
    role: Annotated[Any, PlainValidator(_bad_role)]


Message = Annotated[
    Annotated[UserMessage, Tag("user")]
    | Annotated[AssistantMessage, Tag("assistant")]
    | Annotated[OtherMessage, Tag("other")],
    _union("role", ("user", "assistant"), "must be a message: {role, content}"),
]


# ------------------------------------------------------------------------------ tools


class Tool(_Strict):
    """A client tool (the client runs it)."""

    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise _error("invalid_value", 'must be a JSON schema with "type": "object"')
        return value

    def chat_tool(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.input_schema
        return {"type": "function", "function": function}


def _server_tool(value: Any) -> Any:
    raise _error(
        UNSUPPORTED,
        f"is {value!r}, a server tool, which this server does not run: define a client tool "
        "{name, description, input_schema} and run it yourself",
    )


class ServerTool(_Refused):
    type: Annotated[Any, PlainValidator(_server_tool)]


AnyTool = Annotated[
    Annotated[Tool, Tag("custom")] | Annotated[ServerTool, Tag("other")],
    _union("type", ("custom",), "must be a tool: {name, description, input_schema}", "custom"),
]


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, validate_default=True)
    # true: Chat Completions' parallel_tool_calls false (see `messages`).
    disable_parallel_tool_use: bool | None = None

    @field_validator("name")
    @classmethod
    def _name_with_tool(cls, value: str | None, info: ValidationInfo) -> str | None:
        kind = info.data.get("type")
        if kind == "tool" and value is None:
            raise _error("missing", "is required when 'type' is 'tool'")
        if kind not in (None, "tool") and value is not None:
            raise _error("invalid_value", "is only allowed when 'type' is 'tool'")
        return value


def _thinking(value: Any) -> Any:
    # "adaptive" lets the model decide whether to think; this policy never does, so
    # the answer has no thinking blocks (as an adaptive answer that chose not to).
    if value is None or value in ({"type": "disabled"}, {"type": "adaptive"}):
        return value
    raise _error(
        UNSUPPORTED,
        "is not supported: this server has no extended thinking (only "
        '{"type": "disabled"} or {"type": "adaptive"}, under which it never thinks)',
    )


class ContextEdit(_Strict):
    """One context-management edit: only clearing thinking blocks, of which a
    conversation here never has any (so it changes nothing)."""

    type: Annotated[str, Field(pattern=r"^clear_thinking_\d+$")]
    keep: Any = None


class ContextManagement(_Strict):
    """Anthropic's context_management: clear_thinking edits accepted (a no-op: there
    are no thinking blocks); any other edit (clear_tool_uses_..., which would
    rewrite the conversation the policy saw) is refused at its `type`."""

    edits: list[ContextEdit] = Field(default_factory=list, max_length=16)


class OutputFormat(_Strict):
    """Structured output: the answer is a JSON value of `schema` (decoded under its
    grammar, `structured`), as Chat Completions' response_format json_schema."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """output_config: `format` honoured (structured output); `effort` accepted, not
    acted on (one policy, one way of answering: no effort levels to choose)."""

    effort: Literal["low", "medium", "high", "max"] | None = None
    format: OutputFormat | None = None


# ------------------------------------------------------------------------------ bodies


class Metadata(_Strict):
    """Anthropic's request metadata: accepted, not acted on (never the agent label)."""

    user_id: str | None = Field(None, max_length=MAX_USER_LEN)


class PromptBody(_Strict):
    """What shapes the prompt (all of POST /v1/messages/count_tokens)."""

    model: str = Field(min_length=1)
    system: Annotated[list[TextBlock], BeforeValidator(_as_blocks)] | None = None
    messages: Annotated[list[Message], Field(min_length=1)]
    tools: Annotated[list[AnyTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Annotated[Any, PlainValidator(_thinking)] = None
    cache_control: CacheControl | None = None
    context_management: ContextManagement | None = None
    output_config: OutputConfig | None = None

    @field_validator("messages")
    @classmethod
    def _no_prefill(cls, value: list) -> list:
        if isinstance(value[-1], AssistantMessage):
            raise _error(
                UNSUPPORTED,
                "ends with an assistant message (prefill), which is not supported: end with a "
                "user message (the answer is a new assistant turn)",
            )
        return value

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, value: list[Tool] | None) -> list[Tool] | None:
        names = [t.name for t in value or ()]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise _error("invalid_value", f"names each tool once; defined more than once: {twice}")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, value: ToolChoice | None, info: ValidationInfo) -> Any:
        if value is None or value.type in ("auto", "none") or "tools" not in info.data:
            return value  # nothing to force, or the tools' own error is reported
        names = [t.name for t in info.data["tools"] or ()]
        if not names:
            raise _error(
                "invalid_value", f"{value.type!r} requires a tool call but 'tools' is empty"
            )
        if value.type == "tool" and value.name not in names:
            raise _error(
                "invalid_value", f"names tool {value.name!r}, which is not in 'tools' ({names})"
            )
        return value

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as OpenAI chat messages (see the module docstring)."""
        out: list[dict[str, Any]] = []
        if self.system:
            out.append({"role": "system", "content": _text_parts(self.system)})
        for message in self.messages:
            if isinstance(message, (UserMessage, AssistantMessage)):  # others never validate
                out += message.chat_messages()
        return out

    def chat_tools(self) -> list[dict[str, Any]] | None:
        return [t.chat_tool() for t in self.tools if isinstance(t, Tool)] if self.tools else None


class CreateBody(PromptBody):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1, le=INT32_MAX)
    stop_sequences: Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    temperature: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    metadata: Metadata | None = None
    stream: bool | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # Extensions: the agent label (the X-Agent header wins) and a sampling seed.
    agent: str | None = Field(None, min_length=1, max_length=MAX_AGENT_LEN)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])

    @field_validator("temperature")
    @classmethod
    def _greedy_or_in_range(cls, value: float | None) -> float | None:
        if value is not None and value != 0 and value < TEMPERATURE_RANGE[0]:
            raise _error("invalid_value", f"must be 0 (greedy) or at least {TEMPERATURE_RANGE[0]}")
        return value
