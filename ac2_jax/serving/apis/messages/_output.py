"""What POST /v1/messages answers: the message body and Anthropic's event stream.

`message_body` builds the non-streamed answer (content blocks, stop_reason,
usage split as Anthropic splits it); `MessageEventWriter` is the streaming
`EventWriter` (message_start, ping, content blocks with text_delta /
input_json_delta, message_delta, message_stop, event: error). Both read the
same finished `Choice`, so streamed and plain answers carry the same tokens.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any

from ac2_jax.sampling import SampleResult
from ac2_jax.serving.core import chat as chat_lib
from ac2_jax.serving.core.errors import APIError
from ac2_jax.serving.core.sample_run import RequestState, ServeContext
from ac2_jax.serving.core.stream_generation import EventWriter
from ac2_jax.serving.core.streaming import TextStream

__all__ = [
    "MessageEventWriter",
    "message_body",
    "new_message_id",
    "tool_input",
    "tool_use_id",
]


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use `input`: the JSON object they are; anything
    else (the model's mistake) as {"arguments": value}, so no output is lost."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = arguments
    return value if isinstance(value, dict) else {"arguments": value}


def stop_of(ctx: ServeContext, st: RequestState, choice: chat_lib.Choice) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a choice."""
    if choice.finish_reason == "tool_calls":
        return "tool_use", None
    if choice.finish_reason == "length":
        return "max_tokens", None
    ids, stop = list(choice.result.output_ids), st.req.stop
    if stop and ids and ids[-1] not in ctx.tokenizer.stop_token_ids:
        full = ctx.tokenizer.decode(ids)  # the stop string that ended it, as truncate_at_stop
        hits = [(full.find(s) + len(s), s) for s in stop if s in full]
        if hits:
            return "stop_sequence", min(hits)[1]
    return "end_turn", None


def usage_of(st: RequestState, result: SampleResult) -> dict[str, int]:
    prompt = len(st.prompt_ids)
    cached = min(int(result.cached_tokens), prompt)
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": len(result.output_ids),
    }


def tool_use_blocks(choice: chat_lib.Choice) -> list[dict[str, Any]]:
    return [
        {
            "type": "tool_use",
            "id": tool_use_id(call["id"]),
            "name": call["function"]["name"],
            "input": tool_input(call["function"]["arguments"]),
        }
        for call in choice.tool_calls
    ]


def message_body(ctx: ServeContext, st: RequestState, choice: chat_lib.Choice) -> dict[str, Any]:
    """The Message object of one answered request."""
    content: list[dict[str, Any]] = []
    if choice.content:
        content.append({"type": "text", "text": choice.content})
    content += tool_use_blocks(choice)
    stop_reason, stop_sequence = stop_of(ctx, st, choice)
    return {
        "id": st.response_id,
        "type": "message",
        "role": "assistant",
        "model": ctx.model_name,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage_of(st, choice.result),
    }


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class MessageEventWriter(EventWriter):
    """Anthropic's stream: message_start, ping, per block content_block_start /
    content_block_delta (text_delta; input_json_delta for tool_use) /
    content_block_stop, message_delta (stop_reason, usage), message_stop;
    `event: error` for an error once the headers are out."""

    def __init__(self, ctx: ServeContext, st: RequestState):
        self.ctx = ctx
        self.st = st
        self.text_open = False  # the text block (index 0) has started

    def opening(self) -> Iterable[str]:
        message: dict[str, Any] = {
            "id": self.st.response_id,
            "type": "message",
            "role": "assistant",
            "model": self.ctx.model_name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": len(self.st.prompt_ids),
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": 0,
            },
        }
        yield event("message_start", {"type": "message_start", "message": message})
        yield event("ping", {"type": "ping"})

    def text(self, text: str) -> Iterable[str]:
        if not self.text_open:
            self.text_open = True
            block = {"type": "text", "text": ""}
            yield event(
                "content_block_start",
                {"type": "content_block_start", "index": 0, "content_block": block},
            )
        delta = {"type": "text_delta", "text": text}
        yield event(
            "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
        )

    def delta(self, index: int, text: str, part: SampleResult | None) -> Iterable[str]:
        if text:
            yield from self.text(text)

    def final(self, choices: list, streams: list[TextStream]) -> Iterable[str]:
        (choice,), (stream,) = choices, streams
        rest = stream.rest(choice.content)
        if rest:
            yield from self.text(rest)
        index = 0
        if self.text_open:
            yield event("content_block_stop", {"type": "content_block_stop", "index": 0})
            index = 1
        for block in tool_use_blocks(choice):
            start = {
                "type": "content_block_start",
                "index": index,
                "content_block": {**block, "input": {}},
            }
            yield event("content_block_start", start)
            delta = {
                "type": "input_json_delta",
                "partial_json": json.dumps(block["input"], ensure_ascii=False),
            }
            yield event(
                "content_block_delta",
                {"type": "content_block_delta", "index": index, "delta": delta},
            )
            yield event("content_block_stop", {"type": "content_block_stop", "index": index})
            index += 1
        stop_reason, stop_sequence = stop_of(self.ctx, self.st, choice)
        yield event(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": usage_of(self.st, choice.result),
            },
        )
        yield event("message_stop", {"type": "message_stop"})

    def error(self, err: APIError) -> Iterable[str]:
        yield event("error", err.anthropic_body())
