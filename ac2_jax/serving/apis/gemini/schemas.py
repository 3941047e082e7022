"""Gemini API request bodies (generateContent, streamGenerateContent, countTokens),
validated, and their OpenAI chat form.

The house style of `schemas` (strict types, `extra="forbid"`, a 400 naming the
first bad field), with the Gemini API's field names: camelCase as its JSON
(`systemInstruction`, `functionDeclarations`), snake_case taken too (the REST API
takes both). What each field does is in `gemini`'s docstring.

`GenerateBody.chat_messages()` / `.chat_tools()` are what an OpenAI Chat
Completions client would send for the same conversation: systemInstruction is
the system message; a user content's functionResponse parts are `tool` messages
(before its text), a model content's functionCall parts its `tool_calls`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from ac2_jax.sampling.base import INT32_MAX, MAX_STOP
from ac2_jax.serving.core.schemas import (
    MAX_AGENT_LEN,
    MAX_TOOLS,
    UNSUPPORTED,
    StopText,
    Temperature,
    refuse,
)

TEXT_ONLY = "this server serves a text-only model; send the content as text"


def _error(kind: str, message: str) -> PydanticCustomError:
    return PydanticCustomError(kind, "{message}", {"message": message})


def _no(why: str) -> Any:
    """A field refused unless null, saying `why`."""
    return refuse(why, kind=UNSUPPORTED, allow_null=True)


class _G(BaseModel):
    model_config = ConfigDict(
        extra="forbid", strict=True, alias_generator=to_camel, populate_by_name=True
    )


# ------------------------------------------------------------------------------ contents


def _no_thought(value: bool) -> bool:
    if value:
        raise _error(UNSUPPORTED, "true is not supported: this model never thinks")
    return value


class FunctionCall(_G):
    name: str = Field(min_length=1)
    args: dict[str, Any] | None = None
    id: str | None = None


class FunctionResponse(_G):
    name: str = Field(min_length=1)
    response: dict[str, Any]
    id: str | None = None


class Part(_G):
    """One part: text, a functionCall (model) or a functionResponse (user). Media and
    code-execution parts are refused by name; `thoughtSignature` (an opaque token a
    client echoes) is accepted and never rendered."""

    text: str | None = None
    function_call: FunctionCall | None = None
    function_response: FunctionResponse | None = None
    thought: Annotated[bool, AfterValidator(_no_thought)] | None = None
    thought_signature: str | None = None
    inline_data: Annotated[
        Any, _no(f"is refused: inline images and files are not supported ({TEXT_ONLY})")
    ] = None
    file_data: Annotated[Any, _no(f"is refused: file parts are not supported ({TEXT_ONLY})")] = None
    executable_code: Annotated[Any, _no("is refused: this server runs no code execution")] = None
    code_execution_result: Annotated[Any, _no("is refused: this server runs no code execution")] = (
        None
    )
    video_metadata: Annotated[Any, _no(f"is refused ({TEXT_ONLY})")] = None

    @model_validator(mode="after")
    def _one_kind(self) -> Part:
        kinds = [k for k in ("text", "function_call", "function_response") if getattr(self, k)]
        if self.text == "" and not kinds:
            return self
        if len(kinds) != 1:
            raise _error(
                "invalid_value",
                "a part holds exactly one of text, functionCall, functionResponse",
            )
        return self


class Content(_G):
    role: Literal["user", "model", "function"] | None = None
    parts: list[Part] = Field(min_length=1)

    @model_validator(mode="after")
    def _parts_fit_role(self) -> Content:
        model = self.role == "model"
        for p in self.parts:
            if model and p.function_response is not None:
                raise _error("invalid_value", "a model content cannot hold functionResponse parts")
            if not model and p.function_call is not None:
                raise _error("invalid_value", "only a model content holds functionCall parts")
        return self


class SystemInstruction(_G):
    role: str | None = None
    parts: list[Part] = Field(min_length=1)

    @model_validator(mode="after")
    def _text_only(self) -> SystemInstruction:
        if any(p.text is None for p in self.parts):
            raise _error("invalid_value", "holds text parts only")
        return self


# ------------------------------------------------------------------------------ tools


_SCHEMA_MAPS = ("properties", "$defs", "defs")  # name -> schema
_SCHEMA_ONE = ("items", "additionalProperties", "additional_properties", "not")
_SCHEMA_LISTS = {"anyOf": "anyOf", "any_of": "anyOf", "oneOf": "oneOf", "allOf": "allOf"}
_ORDERING = ("propertyOrdering", "property_ordering")  # display order, no constraint


def json_schema(schema: Any, path: str = "schema") -> Any:
    """A Gemini `Schema` (OpenAPI subset, upper-case types) as JSON schema.

    `type` is lower-cased; `nullable: true` becomes a union with null (type [t,
    "null"], anyOf + {"type": "null"}, and null added to an `enum`; `nullable:
    false` is dropped: JSON schema types exclude null); `propertyOrdering` is
    dropped (the order properties are written in, not a constraint); `format:
    "enum"` (Gemini's marker of an enum string) is dropped, `enum` carries it.
    Subschemas are converted under properties, items, additionalProperties, not and
    anyOf/oneOf/allOf; a property named like a keyword stays a property. ValueError
    naming the path (`path`.properties.a.type) for type TYPE_UNSPECIFIED."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for k, v in schema.items():
        if k in _ORDERING:
            continue
        if k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {n: json_schema(s, f"{path}.{k}.{n}") for n, s in v.items()}
        elif k in _SCHEMA_ONE and isinstance(v, dict):
            out[k] = json_schema(v, f"{path}.{k}")
        elif k in _SCHEMA_LISTS and isinstance(v, list):
            key = _SCHEMA_LISTS[k]
            out[key] = [json_schema(s, f"{path}.{k}[{i}]") for i, s in enumerate(v)]
        else:
            out[k] = v
    kind = out.get("type")
    if isinstance(kind, str):
        if kind.upper() == "TYPE_UNSPECIFIED":
            raise ValueError(
                f"{path}.type: TYPE_UNSPECIFIED is refused: name the type (STRING, NUMBER, "
                "INTEGER, BOOLEAN, ARRAY, OBJECT, NULL)"
            )
        out["type"] = kind = kind.lower()
    if out.get("format") == "enum" and "enum" in out:
        del out["format"]
    nullable = out.pop("nullable", None)
    if nullable is True:
        if isinstance(kind, str):
            out["type"] = [kind, "null"] if kind != "null" else kind
        elif "anyOf" in out:
            out["anyOf"] = [*out["anyOf"], {"type": "null"}]
        if isinstance(out.get("enum"), list) and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
    elif nullable is not None and nullable is not False:
        out["nullable"] = nullable  # not a bool: left for the schema's own checks
    return out


def _gemini_schema(schema: dict[str, Any] | None, path: str) -> None:
    """Refuses (a 400 naming the path) a Gemini Schema `json_schema` cannot convert."""
    if schema is not None:
        try:
            json_schema(schema, path)
        except ValueError as e:
            raise _error("invalid_value", str(e)) from None


class FunctionDeclaration(_G):
    name: str = Field(pattern=r"^[a-zA-Z_][a-zA-Z0-9_.:-]{0,127}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    parameters_json_schema: dict[str, Any] | None = None
    response: dict[str, Any] | None = None  # what the function returns: not rendered
    response_json_schema: dict[str, Any] | None = None
    behavior: Annotated[
        Any, _no("is not supported: calls are answered in the same turn (BLOCKING)")
    ] = None

    @model_validator(mode="after")
    def _one_schema(self) -> FunctionDeclaration:
        if self.parameters is not None and self.parameters_json_schema is not None:
            raise _error("invalid_value", "give parameters or parametersJsonSchema, not both")
        _gemini_schema(self.parameters, "parameters")
        _gemini_schema(self.response, "response")
        return self

    def chat_tool(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        params = self.parameters_json_schema
        if params is None and self.parameters is not None:
            params = json_schema(self.parameters)
        fn["parameters"] = params if params is not None else {"type": "object", "properties": {}}
        return {"type": "function", "function": fn}


_GROUNDING = "is refused: this server runs no grounding or retrieval (declare a function)"


class Tool(_G):
    function_declarations: list[FunctionDeclaration] | None = None
    google_search: Annotated[Any, _no(_GROUNDING)] = None
    google_search_retrieval: Annotated[Any, _no(_GROUNDING)] = None
    retrieval: Annotated[Any, _no(_GROUNDING)] = None
    url_context: Annotated[Any, _no(_GROUNDING)] = None
    file_search: Annotated[Any, _no(_GROUNDING)] = None
    google_maps: Annotated[Any, _no(_GROUNDING)] = None
    enterprise_web_search: Annotated[Any, _no(_GROUNDING)] = None
    code_execution: Annotated[Any, _no("is refused: this server runs no code execution")] = None
    computer_use: Annotated[Any, _no("is refused: this server runs no computer use")] = None


class FunctionCallingConfig(_G):
    mode: Literal["AUTO", "ANY", "NONE", "MODE_UNSPECIFIED"] | None = None
    allowed_function_names: list[str] | None = None

    @model_validator(mode="after")
    def _names_with_any(self) -> FunctionCallingConfig:
        names = self.allowed_function_names
        if names is not None and self.mode != "ANY":
            raise _error("invalid_value", "allowedFunctionNames is only allowed with mode ANY")
        if names is not None and len(names) != 1:
            raise _error(
                UNSUPPORTED,
                "allowedFunctionNames must name one function (a forced call) or be left "
                "out (any declared function); a subset is not supported",
            )
        return self


class ToolConfig(_G):
    function_calling_config: FunctionCallingConfig | None = None


# ------------------------------------------------------------------------------ config


class ThinkingConfig(_G):
    """Accepted: this model never thinks, so no thought parts come back whatever the
    budget (Gemini CLI sends includeThoughts true)."""

    include_thoughts: bool | None = None
    thinking_budget: int | None = Field(None, ge=-1, le=INT32_MAX)
    thinking_level: (
        Literal["LOW", "MEDIUM", "HIGH", "MINIMAL", "THINKING_LEVEL_UNSPECIFIED"] | None
    ) = None


def _whole(value: float) -> float:
    if value != int(value):
        raise _error("invalid_value", "must be a whole number")
    return value


class GenerationConfig(_G):
    temperature: Temperature = None
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    # google-genai sends topK as a float (64.0): any whole number is taken.
    top_k: Annotated[float, AfterValidator(_whole)] | None = Field(None, ge=1, le=INT32_MAX)
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    stop_sequences: Annotated[list[StopText], Field(max_length=MAX_STOP)] | None = None
    candidate_count: Literal[1] | None = None
    seed: int | None = None
    response_mime_type: Literal["text/plain", "application/json"] | None = None
    response_schema: dict[str, Any] | None = None
    response_json_schema: dict[str, Any] | None = None
    response_modalities: list[Literal["TEXT"]] | None = None
    thinking_config: ThinkingConfig | None = None
    presence_penalty: Annotated[Any, _no("is not supported (no penalties here; only null)")] = None
    frequency_penalty: Annotated[Any, _no("is not supported (no penalties here; only null)")] = None
    response_logprobs: Annotated[
        Any, _no("is not supported on this route (use the OpenAI routes)")
    ] = None
    logprobs: Annotated[Any, _no("is not supported on this route (use the OpenAI routes)")] = None
    speech_config: Annotated[Any, _no(f"is refused ({TEXT_ONLY})")] = None
    media_resolution: Annotated[Any, _no(f"is refused ({TEXT_ONLY})")] = None

    @model_validator(mode="after")
    def _schema_needs_json(self) -> GenerationConfig:
        schemas = [s for s in (self.response_schema, self.response_json_schema) if s is not None]
        if len(schemas) > 1:
            raise _error("invalid_value", "give responseSchema or responseJsonSchema, not both")
        if schemas and self.response_mime_type != "application/json":
            raise _error(
                "invalid_value", "a response schema needs responseMimeType application/json"
            )
        _gemini_schema(self.response_schema, "responseSchema")
        return self

    def response_format(self) -> dict | None:
        if self.response_mime_type != "application/json":
            return None
        schema = self.response_json_schema
        if schema is None and self.response_schema is not None:
            schema = json_schema(self.response_schema)
        if schema is None:
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}


# ------------------------------------------------------------------------------ bodies


NO_FILTER = ("BLOCK_NONE", "OFF", "HARM_BLOCK_THRESHOLD_UNSPECIFIED")


def _no_filter(value: str | None) -> str | None:
    if value is not None and value.upper() not in NO_FILTER:
        raise _error(
            UNSUPPORTED,
            f"{value!r} is refused: this server has no safety filter; send one of "
            f"{', '.join(NO_FILTER)} (no filtering) or leave safetySettings out",
        )
    return value


class SafetySetting(_G):
    """One safety setting: accepted only with a threshold that means no filtering
    (`NO_FILTER`, any case), since this server filters nothing; any other threshold
    is a 400 naming it, never a setting silently not applied."""

    category: str | None = None
    threshold: Annotated[str | None, AfterValidator(_no_filter)] = None
    method: str | None = None  # Vertex's HarmBlockMethod: moot without a filter


class GenerateBody(_G):
    """generateContent / streamGenerateContent (and countTokens' generateContentRequest)."""

    model: str | None = None  # countTokens' generateContentRequest names it; the path wins
    contents: list[Content] = Field(min_length=1)
    system_instruction: SystemInstruction | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_config: ToolConfig | None = None
    generation_config: GenerationConfig | None = None
    # Accepted only when they ask for no filtering (this server has none); labels:
    # accepted, no effect (nothing billed).
    safety_settings: list[SafetySetting] | None = None
    labels: dict[str, str] | None = None
    cached_content: Annotated[
        Any, _no("is not supported: send the content itself (prefix caching is automatic)")
    ] = None
    # Extension: the agent label (the X-Agent header wins).
    agent: str | None = Field(None, min_length=1, max_length=MAX_AGENT_LEN)

    @model_validator(mode="after")
    def _last_from_user(self) -> GenerateBody:
        if self.contents[-1].role == "model":
            raise _error(
                UNSUPPORTED,
                "contents ends with a model content (prefill), which is not supported: end with "
                "a user content (the answer is a new model turn)",
            )
        return self

    def declarations(self) -> list[FunctionDeclaration]:
        return [d for t in self.tools or () for d in t.function_declarations or ()]

    def chat_tools(self) -> list[dict[str, Any]] | None:
        return [d.chat_tool() for d in self.declarations()] or None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as OpenAI chat messages. A functionCall without an id gets
        "call_<content>_<part>"; a functionResponse without one answers the earliest
        unanswered call of its name (ValueError naming it when there is none, or when
        the call its id names is of another function)."""
        out: list[dict[str, Any]] = []
        if self.system_instruction is not None:
            text = "\n".join(p.text or "" for p in self.system_instruction.parts)
            out.append({"role": "system", "content": text})
        pending: list[tuple[str, str]] = []  # (name, id) of unanswered calls
        for i, content in enumerate(self.contents):
            texts = [p.text for p in content.parts if p.text is not None]
            if content.role == "model":
                calls = []
                for j, p in enumerate(content.parts):
                    if p.function_call is None:
                        continue
                    fc = p.function_call
                    cid = fc.id or f"call_{i}_{j}"
                    pending.append((fc.name, cid))
                    args = json.dumps(fc.args or {}, ensure_ascii=False)
                    calls.append(
                        {
                            "id": cid,
                            "type": "function",
                            "function": {"name": fc.name, "arguments": args},
                        }
                    )
                msg: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) or None}
                if calls:
                    msg["tool_calls"] = calls
                out.append(msg)
                continue
            for j, p in enumerate(content.parts):
                fr = p.function_response
                if fr is None:
                    continue
                match = [
                    k for k, (n, c) in enumerate(pending) if (c == fr.id if fr.id else n == fr.name)
                ]
                if not match:
                    raise ValueError(
                        f"contents[{i}].parts[{j}].functionResponse answers no earlier "
                        f"functionCall ({f'id {fr.id!r}' if fr.id else f'name {fr.name!r}'}); "
                        "send the model content with the call too"
                    )
                name, cid = pending.pop(match[0])
                if name != fr.name:
                    raise ValueError(
                        f"contents[{i}].parts[{j}].functionResponse names {fr.name!r} but "
                        f"answers the call {cid!r} of {name!r}; send the call's name"
                    )
                result = json.dumps(fr.response, ensure_ascii=False)
                out.append({"role": "tool", "tool_call_id": cid, "content": result})
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
        return out


class CountedRequest(GenerateBody):
    """What countTokens counts: a generateContent request, except that it may end with
    a model content (a history is counted as it stands; nothing is generated)."""

    @model_validator(mode="after")
    def _last_from_user(self) -> CountedRequest:
        return self


class CountTokensBody(_G):
    """countTokens: `contents`, or a whole `generateContentRequest`."""

    contents: list[Content] | None = None
    generate_content_request: CountedRequest | None = None

    @model_validator(mode="after")
    def _one(self) -> CountTokensBody:
        if (self.contents is None) == (self.generate_content_request is None):
            raise _error("invalid_value", "give contents or generateContentRequest (one of them)")
        return self

    def generate_body(self) -> GenerateBody:
        if self.generate_content_request is not None:
            return self.generate_content_request
        return CountedRequest.model_validate(
            {
                "contents": [
                    c.model_dump(by_alias=True, exclude_none=True) for c in self.contents or ()
                ]
            }
        )
