"""Anthropic Messages content blocks and messages, validated, and their chat form.

The pydantic models of `messages_schemas`' `messages` field (strict,
`extra="forbid"`, 400 naming the field): text, tool_use and tool_result
blocks, image/document blocks refused by name, user and assistant messages
as tagged unions whose unknown tags go to a member that refuses them.
`UserMessage.chat_messages()` / `AssistantMessage.chat_messages()` /
`SystemMessage.chat_messages()` (a mid-conversation system turn) are the
OpenAI chat messages a Chat Completions client would send (see
`messages_schemas`).
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
)
from pydantic_core import PydanticCustomError

from ac2_jax.serving.core.schemas import UNSUPPORTED, refuse

TOOL_NAME = r"^[a-zA-Z0-9_-]{1,128}$"
TOOL_ERROR_PREFIX = "Error: "  # what a tool_result with is_error true starts with
TEXT_ONLY = "this server serves a text-only model; send the content as text"
# The tags of the tagged-union lists, by the list's field name (in error locations
# after the item's index: `messages.validate` leaves them out).
UNION_TAGS = {
    "messages": {"user", "assistant", "system", "other"},
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


# Anthropic's own wording of a refused message role. Claude Code's fallback for servers
# without mid-conversation system messages (it resends them as <system-reminder> user
# text) fires only on a 400 whose message has "Unexpected role" and "input message role".
SYSTEM_ROLE_REFUSED = (
    'Unexpected role "system". The Messages API accepts a top-level `system` parameter, '
    'not "system" as an input message role'
)


def _bad_role(value: Any) -> Any:
    raise _error(
        "invalid_value",
        f'Unexpected role {json.dumps(value)}. The Messages API accepts "user", '
        '"assistant" and (mid-conversation) "system" as an input message role',
    )


class SystemMessage(_Strict):
    """A mid-conversation system message (Anthropic's beta
    `mid-conversation-system-2026-04-07`; Claude Code 2.1 sends one): text blocks,
    a system turn at its place in the conversation, rendered as the chat template
    renders a system message there (`messages`)."""

    role: Literal["system"]
    content: Annotated[list[TextBlock], Field(min_length=1), BeforeValidator(_as_blocks)]

    def chat_messages(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": _text_parts(self.content)}]


class OtherMessage(_Refused):
    role: Annotated[Any, PlainValidator(_bad_role)]


Message = Annotated[
    Annotated[UserMessage, Tag("user")]
    | Annotated[AssistantMessage, Tag("assistant")]
    | Annotated[SystemMessage, Tag("system")]
    | Annotated[OtherMessage, Tag("other")],
    _union("role", ("user", "assistant", "system"), "must be a message: {role, content}"),
]
