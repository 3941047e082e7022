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

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    PlainValidator,
    Tag,
    ValidationInfo,
    field_validator,
)

from ac2_jax.sampling.base import INT32_MAX, MAX_STOP
from ac2_jax.serving.apis.messages._blocks import (
    TOOL_NAME,
    AssistantMessage,
    CacheControl,
    Message,
    SystemMessage,
    TextBlock,
    UserMessage,
    _as_blocks,
    _error,
    _Refused,
    _Strict,
    _text_parts,
    _union,
)
from ac2_jax.serving.core.schemas import (
    MAX_AGENT_LEN,
    MAX_TOOLS,
    MAX_USER_LEN,
    SEED_RANGE,
    UNSUPPORTED,
    StopText,
    greedy_or_sampling,
)

# Anthropic's temperature range is [0, 1] (0 greedy).
AnthropicTemperature = Annotated[
    float | None, Field(ge=0, le=1, allow_inf_nan=False), AfterValidator(greedy_or_sampling)
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
            if isinstance(message, (UserMessage, AssistantMessage, SystemMessage)):
                out += message.chat_messages()
        return out

    @property
    def has_system_turns(self) -> bool:
        """Whether `messages` holds a mid-conversation system message."""
        return any(isinstance(m, SystemMessage) for m in self.messages)

    def chat_tools(self) -> list[dict[str, Any]] | None:
        return [t.chat_tool() for t in self.tools if isinstance(t, Tool)] if self.tools else None


class CreateBody(PromptBody):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1, le=INT32_MAX)
    stop_sequences: Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    temperature: AnthropicTemperature = None
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0, le=INT32_MAX)
    metadata: Metadata | None = None
    stream: bool | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # Extensions: the agent label (the X-Agent header wins) and a sampling seed.
    agent: str | None = Field(None, min_length=1, max_length=MAX_AGENT_LEN)
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
