"""The one validation layer of the serving routes: pydantic request models.

Every request body is checked by `validate(model_cls, body)`: the model (strict
types, `extra="forbid"`) holds every field-level rule, and the first error
becomes an OpenAI-shaped 400 whose `param` is the pydantic error location
(`messages[0].role`, `metadata.agent`, `stop`). No field is silently ignored:
an unknown field is a 400 naming it (`code="unsupported_field"`), an OpenAI
field this server does not implement is taken as absent when null and refused
otherwise.

`SamplingBody` holds the fields every sampling API shares (model, n,
max_tokens, temperature, top_p, top_k, stop, seed, stream, labels, the refused
OpenAI knobs); `ChatCompletionBody` and `CompletionBody` add their own. A new
request API (OpenAI Responses, Anthropic Messages) subclasses `SamplingBody`
and inherits its validation; it needs no validator of its own.

Building blocks:
  whole(expected)    reports any error inside a field's value as one error at
                     the field (a union's members, a list's items), saying
                     `expected`.
  shaped(shape, ...) the same for a field kept as the client sent it once it
                     validates as `shape` (tools render into the prompt as sent).
  refuse(...)        a field that may appear only as null (`unimplemented`), or
                     never (`metadata.agent`).
Errors of type `unsupported_field` are answered with that code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    WrapValidator,
    field_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from ac2_jax.sampling.base import INT32_MAX, MAX_STOP, MAX_STOP_CHARS, TEMPERATURE_RANGE
from ac2_jax.serving.core.errors import APIError, bad_request

MAX_N = 64
MAX_TOP_LOGPROBS = 20
MAX_TOOLS = 128
MAX_AGENT_LEN = 128
MAX_USER_LEN = 256
SEED_RANGE = (-(2**63), 2**64 - 1)
ROLES = ("system", "developer", "user", "assistant", "tool")
UNSUPPORTED = "unsupported_field"  # the error type (and the API error code) of a refused knob

M = TypeVar("M", bound=BaseModel)


# ------------------------------------------------------------------------------ errors


def _error(kind: str, message: str) -> PydanticCustomError:
    # The message goes through the context: it may hold braces ({"type": "text"}).
    return PydanticCustomError(kind, "{message}", {"message": message})


def param_of(loc: tuple[int | str, ...]) -> str | None:
    """A pydantic error location as the API names a field: ("messages", 0, "role")
    -> "messages[0].role"; () -> None (the body itself)."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def api_error(model_cls: type[BaseModel], exc: ValidationError) -> APIError:
    """The 400 for a failed validation: its first error (an unknown field first,
    as the client most likely misspelled it), naming the field."""
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    err = errors[0]
    param = param_of(tuple(err["loc"]))
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        fields = list(model_cls.model_fields) if len(err["loc"]) == 1 else None
        expected = f" (expected some of {fields})" if fields else ""
        return bad_request(
            f"Field '{param}' is unknown{expected}; remove it", param=param, code=UNSUPPORTED
        )
    if kind == "missing":
        return bad_request(f"'{param}' is required", param=param)
    if kind == UNSUPPORTED:
        return bad_request(f"'{param}' {msg}", param=param, code=UNSUPPORTED)
    return bad_request(f"'{param or 'body'}': {msg}", param=param)


def untagged(loc: tuple[int | str, ...], union_tags: dict[str, set[str]]) -> tuple[int | str, ...]:
    """An error location as the client wrote the field: the tags of tagged-union list
    items (`union_tags`: list field name -> its tags, which pydantic puts after the
    item's index) left out."""
    return tuple(
        part
        for i, part in enumerate(loc)
        if not (
            i >= 2
            and isinstance(loc[i - 1], int)
            and isinstance(loc[i - 2], str)
            and part in union_tags.get(str(loc[i - 2]), ())
        )
    )


def validate(model_cls: type[M], body: Any, union_tags: dict[str, set[str]] | None = None) -> M:
    """`model_cls` from a parsed JSON body, or the 400 naming the first bad field
    (with `union_tags`, the tags of tagged-union list items left out of its name)."""
    if not isinstance(body, dict):
        raise bad_request(f"Request body must be a JSON object, got {type(body).__name__}")
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        if union_tags:
            errors = [
                InitErrorDetails(
                    type=PydanticCustomError(err["type"], "{message}", {"message": err["msg"]}),
                    loc=untagged(tuple(err["loc"]), union_tags),
                    input=err["input"],
                )
                for err in e.errors()
            ]
            e = ValidationError.from_exception_data(e.title, errors)
        raise api_error(model_cls, e) from None


# ------------------------------------------------------------------------------ field kinds


def only_when_streaming(cls: Any, value: Any, info: ValidationInfo) -> Any:
    """A `stream_options` field's validator (`field_validator("stream_options")(...)`):
    only with `stream` true."""
    if value is not None and not info.data.get("stream"):
        raise _error("invalid_value", "is only allowed when 'stream' is true")
    return value


def greedy_or_sampling(value: float | None) -> float | None:
    """A temperature is 0 (greedy) or at least the sampler's smallest (TEMPERATURE_RANGE)."""
    if value is not None and value != 0 and value < TEMPERATURE_RANGE[0]:
        raise _error("invalid_value", f"must be 0 (greedy) or at least {TEMPERATURE_RANGE[0]}")
    return value


# An OpenAI request's temperature: null, 0 (greedy) or [TEMPERATURE_RANGE[0], 2].
Temperature = Annotated[
    float | None, Field(ge=0, le=2, allow_inf_nan=False), AfterValidator(greedy_or_sampling)
]


def whole(expected: str) -> WrapValidator:
    """Any error inside the value is one error at the field: "`expected`"."""

    def check(value: Any, handler: Callable[[Any], Any]) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise _error("invalid_value", expected) from None

    return WrapValidator(check)


def shaped(shape: Any, expected: str, then: Callable[[Any], Any] = lambda v: v) -> PlainValidator:
    """The value as sent (through `then`) once it validates as `shape`; else one
    error at the field: "`expected`". The field's own type is what the value is."""
    adapter: TypeAdapter[Any] = TypeAdapter(shape)

    def check(value: Any) -> Any:
        try:
            adapter.validate_python(value, strict=True)
        except ValidationError:
            raise _error("invalid_value", expected) from None
        return then(value)

    return PlainValidator(check)


def refuse(message: str, *, kind: str = "refused", allow_null: bool = False) -> PlainValidator:
    """A field that is refused when present (or only when not null)."""

    def check(value: Any) -> None:
        if allow_null and value is None:
            return None
        raise _error(kind, message)

    return PlainValidator(check)


def _only(ok: Callable[[Any], bool], message: str) -> AfterValidator:
    def check(value: Any) -> Any:
        if not ok(value):
            raise _error(UNSUPPORTED, message)
        return value

    return AfterValidator(check)


Unimplemented = Annotated[
    Any,
    refuse("is not implemented by this server; remove it", kind=UNSUPPORTED, allow_null=True),
]
Penalty = (
    Annotated[
        float,
        Field(ge=-2, le=2, allow_inf_nan=False),
        _only(lambda v: v == 0, "is not supported (only 0 or null)"),
    ]
    | None
)
StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Stop = (
    Annotated[
        StopText | Annotated[list[StopText], Field(max_length=MAX_STOP)],
        whole(
            f"must be a string or a list of up to {MAX_STOP} non-empty strings of at most "
            f"{MAX_STOP_CHARS} characters"
        ),
    ]
    | None
)


def _empty_bias(value: Any) -> Any:
    if value is None or (isinstance(value, dict) and not value):
        return value
    raise _error(UNSUPPORTED, "is not supported (only {} or null)")


class _Shape(BaseModel):
    """A sub-object of which only some keys are checked; the rest pass as sent."""

    model_config = ConfigDict(extra="allow", strict=True)


class FunctionName(_Shape):
    name: str


class FunctionShape(_Shape):
    function: FunctionName


class NamedToolChoice(_Shape):
    type: Literal["function"]
    function: FunctionName


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["json_object"]


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = (
    Annotated[
        dict[str, Any],
        shaped(
            TextFormat | JsonObjectFormat | JsonSchemaFormat,
            'must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
            '"json_schema": {"name": "[a-zA-Z0-9_-]{1,64}", "schema": {...}, "strict": bool, '
            '"description": str}}',
        ),
    ]
    | None
)


class Metadata(_Shape):
    """OpenAI's stored-completion tags: accepted, not acted on; never the agent label."""

    agent: Annotated[
        Any,
        refuse("does not label the agent; send the X-Agent header or the top-level 'agent' field"),
    ] = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


ToolCalls = (
    Annotated[
        list[dict[str, Any]],
        shaped(list[FunctionShape], "must be a list of {function: {name, ...}} calls"),
    ]
    | None
)


class Message(BaseModel):
    """One chat message. Keys outside the OpenAI message fields this server reads
    (refusal, audio, annotations, ...) are dropped, as the chat template never sees them."""

    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: ToolCalls = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    content: (
        Annotated[
            str | list[TextPart],
            whole("must be a string or a list of text parts (only text parts are supported)"),
        ]
        | None
    ) = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_required(cls, value: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if value is not None or role is None or "tool_calls" not in info.data:
            return value  # present, or the role / tool_calls error is reported first
        if role != "assistant":
            raise _error("missing", f"is required for role {role!r}")
        if not info.data["tool_calls"]:
            raise _error("missing", "an assistant message needs content or tool_calls")
        return value

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content

    def normalized(self) -> dict[str, Any]:
        """The message as the chat template gets it: developer -> system, text
        content as one string, null keys left out."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        for key, value in (
            ("content", self.text()),
            ("name", self.name),
            ("tool_calls", self.tool_calls),
            ("tool_call_id", self.tool_call_id),
            ("reasoning_content", self.reasoning_content),
        ):
            if value is not None:
                out[key] = value
        return out


Messages = Annotated[list[Message], Field(min_length=1)]


class MessagesBody(BaseModel):
    """Just the messages of a chat request (`requests.normalize_messages`)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    messages: Messages


# ------------------------------------------------------------------------------ requests


class SamplingBody(BaseModel):
    """The fields every sampling API shares, and the rules on them."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str = Field(min_length=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    temperature: Temperature = None
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    stop: Stop = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: bool | None = None
    stream_options: Annotated[StreamOptions, whole('must be {"include_usage": bool}')] | None = None
    # Labels: OpenAI's end-user id (never the agent label) and our `agent` extension.
    user: str | None = Field(None, max_length=MAX_USER_LEN)
    agent: str | None = Field(None, min_length=1, max_length=MAX_AGENT_LEN)
    metadata: Metadata | None = None
    # OpenAI knobs accepted only at their neutral value.
    logit_bias: Annotated[Any, PlainValidator(_empty_bias)] = None
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    # OpenAI fields this server does not implement: null is taken as absent.
    functions: Unimplemented = None
    function_call: Unimplemented = None
    store: Unimplemented = None
    service_tier: Unimplemented = None
    modalities: Unimplemented = None
    audio: Unimplemented = None
    prediction: Unimplemented = None
    reasoning_effort: Unimplemented = None
    web_search_options: Unimplemented = None
    min_p: Unimplemented = None
    repetition_penalty: Unimplemented = None

    _only_when_streaming = field_validator("stream_options")(only_when_streaming)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionBody(SamplingBody):
    """POST /v1/chat/completions."""

    messages: Messages
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: (
        Annotated[
            list[dict[str, Any]],
            shaped(
                Annotated[list[FunctionShape], Field(max_length=MAX_TOOLS)],
                f"must be a list of up to {MAX_TOOLS} {{type: function, function: {{name, ...}}}}",
            ),
        ]
        | None
    ) = None
    tool_choice: (
        Annotated[
            str | dict[str, Any],
            shaped(
                Literal["auto", "none", "required"] | NamedToolChoice,
                "must be 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}',
            ),
        ]
        | None
    ) = None
    # false: a constrained tool-call turn (`serving.core.structured`) holds one call.
    parallel_tool_calls: bool | None = None
    # json_object / json_schema: the answer is constrained to it (`serving.core.structured`).
    response_format: ResponseFormat = None

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or value in ("auto", "none") or "tools" not in info.data:
            return value  # nothing to force, or the tools' own error is reported
        names = [t["function"]["name"] for t in info.data["tools"] or ()]
        if isinstance(value, dict) and value["function"]["name"] not in names:
            raise _error(
                "invalid_value",
                f"names function {value['function']['name']!r}, which is not in 'tools' ({names})",
            )
        if not names:
            raise _error("invalid_value", "requires a tool call but 'tools' is empty")
        return value

    @property
    def forced_tool(self) -> str | None:
        """The function a named tool_choice forces."""
        choice = self.tool_choice
        return choice["function"]["name"] if isinstance(choice, dict) else None


PromptOne = Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]


def _batch_of_one(value: Any) -> Any:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        return value[0]
    return value


class CompletionBody(SamplingBody):
    """POST /v1/completions (legacy text completions)."""

    prompt: Annotated[
        str | list[int],
        shaped(
            PromptOne | Annotated[list[PromptOne], Field(min_length=1, max_length=1)],
            "must be a non-empty string or list of token ids "
            "(batches of several prompts are not supported)",
            then=_batch_of_one,
        ),
    ]
    # Legacy: an integer is the number of top tokens (and turns logprobs on).
    logprobs: (
        Annotated[
            bool | Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)],
            whole(f"must be a boolean or an integer in [0, {MAX_TOP_LOGPROBS}]"),
        ]
        | None
    ) = None
    echo: Annotated[bool, _only(lambda v: not v, "is not supported")] | None = None
    suffix: Annotated[Any, _only(lambda v: not v, "is not supported")] = None
    best_of: Annotated[
        Any,
        _only(lambda v: v is None or (v == 1 and not isinstance(v, bool)), "is not supported"),
    ] = None
