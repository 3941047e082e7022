"""Structured output: the grammar a chat request's answer must follow.

`request_constraint(tokenizer, req)` is the one mapping from a `ChatRequest`
to `SamplingParams.constraint` (`ac2_jax.sampling.constraints`); every
request API that builds a `ChatRequest` gets it through
`generation.start_request`:

- tool_choice "required" / a named function: a whole tool-call turn
  (`tool_call_grammar`): calls of the request's tools (of the named one),
  arguments valid under each tool's `parameters`, one call when
  parallel_tool_calls is false; then the turn ends. Such a turn has no text
  content, so a response_format has nothing to shape there. One that
  max_tokens cuts inside a call did not parse: it is answered as text, with no
  tool calls (`chat.choice_from_result`).
- response_format json_object / json_schema: one JSON object / one value of
  the schema. When the model may also call tools (tools with tool_choice
  "auto"), the turn is either tool calls or that JSON answer.
- anything else: None (free text).

The constrained tokens are sampled (and trained on) with their log-probs
under the grammar's mask; the grammar is recorded on the trace's
`Completion.constraint`. A tokenizer whose tool-call format has no grammar
builder (`grammar_forces_calls` false: only Hermes has one), or a sampler
that decodes no grammars (`sampler_grammars` false: SGLang), keeps the older
mechanism for tool_choice, the call opening written into the prompt
(`generation.forced_prefix`), and refuses JSON output formats. A schema (or
tool parameters) llguidance refuses is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from ac2_jax.sampling.constraints import (
    check_grammar,
    json_schema_grammar,
    tool_call_grammar,
)
from ac2_jax.serving.core.errors import bad_request
from ac2_jax.serving.core.requests import ChatRequest

__all__ = [
    "forces_call",
    "grammar_forces_calls",
    "request_constraint",
    "response_schema",
    "sampler_grammars",
]


def grammar_forces_calls(tokenizer: Any) -> bool:
    """Whether `tool_call_grammar` can write this tokenizer's tool-call format."""
    return getattr(getattr(tokenizer, "tool_parser", None), "name", None) == "hermes"


def forces_call(req: ChatRequest) -> bool:
    """tool_choice asks for a call ("required" or a named function)."""
    return bool(req.tools) and (req.tool_choice == "required" or req.forced_tool is not None)


def response_schema(response_format: dict | None) -> dict | None:
    """The JSON schema a response_format asks the answer to follow (None: text)."""
    fmt = response_format or {}
    kind = fmt.get("type", "text")
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        schema = fmt["json_schema"].get("schema")
        return {} if schema is None else schema  # no schema: any JSON value
    return None


def _checked(grammar_of, tokenizer: Any, param: str) -> str:
    """grammar_of() checked by llguidance; a refusal is a 400 naming `param`."""
    try:
        grammar = grammar_of()
        check_grammar(grammar, tokenizer)
    except ValueError as e:
        raise bad_request(f"'{param}' cannot be enforced: {e}", param=param) from None
    return grammar


def sampler_grammars(sampler: Any) -> bool:
    """Whether `sampler` decodes grammars (`Sampler.supports_constraints`)."""
    return bool(getattr(sampler, "supports_constraints", False))


def request_constraint(tokenizer: Any, req: ChatRequest, grammars: bool = True) -> str | None:
    """The llguidance grammar `req`'s answer must follow, or None (see the module
    docstring). 400 naming the field for a schema the grammar cannot take.

    grammars: whether the sampler decodes grammars (`sampler_grammars`). Without
    them tool_choice keeps the forced tool-call opening (no guarantee that the
    call parses, as before grammars) and a JSON output format is refused."""
    parallel = req.parallel_tool_calls is not False
    schema = response_schema(req.response_format)
    if forces_call(req):
        if not (grammars and grammar_forces_calls(tokenizer)):
            return None  # the forced prefix opens the call instead
        return _checked(
            lambda: tool_call_grammar(
                tokenizer, req.tools or [], req.forced_tool, parallel=parallel
            ),
            tokenizer,
            "tools",
        )
    if schema is None:
        return None
    if not grammars:
        raise bad_request(
            "'response_format' needs grammar-constrained decoding, which this server's "
            "sampler does not do (SGLang: its grammar backends' masks cannot be replayed by "
            "the learner); drop response_format or serve with the embedded JaxSampler",
            param="response_format",
        )
    answer = _checked(lambda: json_schema_grammar(schema), tokenizer, "response_format")
    if not req.parse_tools:
        return answer
    if not grammar_forces_calls(tokenizer):
        raise bad_request(
            "'response_format' with tools the model may call needs a grammar of the "
            f"model's tool-call format ({tokenizer.tool_parser.name!r} has none): set "
            "tool_choice to 'none' (a JSON answer) or 'required' (tool calls)",
            param="response_format",
        )
    return _checked(
        lambda: tool_call_grammar(tokenizer, req.tools or [], parallel=parallel, or_json=schema),
        tokenizer,
        "tools",
    )
