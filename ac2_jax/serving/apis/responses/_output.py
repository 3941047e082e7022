"""What POST /v1/responses answers: the response object (`Answer`) and, with
stream=true, its events (`ResponsesWriter`, an `EventWriter`).

The response: id "resp_...", status completed, or incomplete (reason
max_output_tokens) when the output hit its cap; output: an assistant message
item (one output_text part) when the model wrote text or no call, then one
function_call item per call (id "fc_..." beside the call's "call_..." id);
usage (input_tokens with the prefix-cache hits, output_tokens, no reasoning
tokens); the request fields it echoes; `policy_version` (as chat responses).

The events are named server-sent events (`event: <type>` then `data:
{...}`), each with a `sequence_number` from 0: response.created and
response.in_progress (the response with no output yet); when the model
writes text, response.output_item.added (the message, output_index 0) and
response.content_part.added, then one response.output_text.delta per piece of
text as tokens arrive (`streaming.TextStream` holds back what may still
change), with the logprobs of its tokens when they were asked for; once
sampled and recorded: the rest of the text, response.output_text.done,
response.content_part.done and response.output_item.done; per function call
response.output_item.added, response.function_call_arguments.delta (the
whole arguments) and .done, response.output_item.done; last
response.completed or response.incomplete, with the response a plain request
gets. An error once the stream is open is an `error` event, then
response.failed (with the error), and the stream ends.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ac2_jax.sampling import SampleResult
from ac2_jax.serving.apis.responses.schemas import ResponsesBody, function_tools
from ac2_jax.serving.core import chat as chat_lib
from ac2_jax.serving.core.errors import APIError
from ac2_jax.serving.core.sample_run import RequestState, ServeContext
from ac2_jax.serving.core.stream_generation import EventWriter
from ac2_jax.serving.core.streaming import TextStream

# keep(rollout, body, output as conversation items): stores an answered response.
Keep = Callable[[Any, dict, list[dict]], None]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Answer:
    """One response being made: its ids, the request fields it echoes and its
    output; `keep` (None: store=false) stores it once answered."""

    def __init__(self, ctx: ServeContext, body: ResponsesBody, keep: Keep | None):
        self.ctx = ctx
        self.id = new_id("resp")
        self.msg_id = new_id("msg")
        self.created_at = int(time.time())
        self.keep = keep if body.store is not False else None
        # The namespace of each namespaced function: its calls carry it (as OpenAI's do).
        self.namespaces = {t.name: ns for t, ns in function_tools(body.tools) if ns}
        reasoning = body.reasoning
        text = body.text
        self.echo = {
            "instructions": body.instructions,
            "metadata": dict(body.metadata.model_extra or {}) if body.metadata else {},
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "tool_choice": body.tool_choice or "auto",
            "tools": [t.model_dump() for t in body.tools or ()],
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "reasoning": {
                "effort": reasoning.effort if reasoning else None,
                "summary": reasoning.summary if reasoning else None,
            },
            "store": body.store is not False,
            "text": {
                "format": (text.format if text else None) or {"type": "text"},
                "verbosity": "medium",
            },
            "truncation": "disabled",
            "top_logprobs": body.top_logprobs or 0,
            "user": body.user,
            "safety_identifier": body.safety_identifier,
            "prompt_cache_key": body.prompt_cache_key,
            "service_tier": "default",
            "background": False,
        }

    def envelope(
        self,
        status: str,
        output: list[dict],
        usage: dict | None,
        version: int,
        error: dict | None = None,
    ) -> dict:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "model": self.ctx.model_name,
            "output": output,
            "usage": usage,
            **self.echo,
            "policy_version": version,
        }

    def text_part(self, st: RequestState, choice: chat_lib.Choice) -> dict:
        part: dict[str, Any] = {
            "type": "output_text",
            "text": choice.content or "",
            "annotations": [],
        }
        if st.req.logprobs:
            lps = chat_lib.chat_logprobs(self.ctx.tokenizer, choice.result, st.req.top_logprobs)
            part["logprobs"] = lps["content"]
        return part

    def output(self, st: RequestState, choice: chat_lib.Choice) -> list[dict]:
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        out: list[dict] = []
        if choice.content or not choice.tool_calls:
            out.append(
                {
                    "type": "message",
                    "id": self.msg_id,
                    "status": status,
                    "role": "assistant",
                    "content": [self.text_part(st, choice)],
                }
            )
        for call in choice.tool_calls:
            item = {
                "type": "function_call",
                "id": "fc_" + call["id"].removeprefix("call_"),
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
            if item["name"] in self.namespaces:
                item["namespace"] = self.namespaces[item["name"]]
            out.append(item)
        return out

    def finish(self, st: RequestState, choices: list[chat_lib.Choice], version: int) -> dict:
        """The response of a sampled, recorded request (stored unless store=false)."""
        (choice,) = choices
        r = choice.result
        usage = {
            "input_tokens": len(st.prompt_ids),
            "input_tokens_details": {"cached_tokens": int(r.cached_tokens)},
            "output_tokens": len(r.output_ids),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(st.prompt_ids) + len(r.output_ids),
        }
        output = self.output(st, choice)
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        body = self.envelope(status, output, usage, version)
        if self.keep is not None:
            said = [
                {"type": "message", "role": "assistant", "content": it["content"][0]["text"]}
                if it["type"] == "message"
                else {
                    k: it[k]
                    for k in ("type", "call_id", "name", "arguments", "namespace")
                    if k in it
                }
                for it in output
            ]
            self.keep(st.principal.rollout, body, said)
        return body


class ResponsesWriter(EventWriter):
    """The Responses API events of one streamed request."""

    def __init__(self, ctx: ServeContext, st: RequestState, answer: Answer):
        self.ctx = ctx
        self.st = st
        self.answer = answer
        self.seq = 0
        self.message_open = False
        self.held_logprobs: list[dict] = []  # of tokens that came before any text
        self.sent_logprobs = 0  # how many went out in deltas

    def event(self, kind: str, **fields: Any) -> str:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def where(self) -> dict[str, Any]:
        return {"item_id": self.answer.msg_id, "output_index": 0, "content_index": 0}

    def open_message(self) -> Iterator[str]:
        if self.message_open:
            return
        self.message_open = True
        item = {
            "type": "message",
            "id": self.answer.msg_id,
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        yield self.event("response.output_item.added", output_index=0, item=item)
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
        if self.st.req.logprobs:
            part["logprobs"] = []
        yield self.event("response.content_part.added", part=part, **self.where())

    def opening(self) -> Iterable[str]:
        empty = self.answer.envelope("in_progress", [], None, self.ctx.sampler.policy_version)
        yield self.event("response.created", response=empty)
        yield self.event("response.in_progress", response=empty)

    def delta(self, index: int, text: str, part: SampleResult | None) -> Iterable[str]:
        if part is not None:
            lps = chat_lib.chat_logprobs(self.ctx.tokenizer, part, 0)["content"]
            self.held_logprobs += lps
        if not text:
            return
        yield from self.open_message()
        lps, self.held_logprobs = self.held_logprobs, []
        self.sent_logprobs += len(lps)
        yield self.event("response.output_text.delta", delta=text, logprobs=lps, **self.where())

    def final(self, choices: list, streams: list[TextStream]) -> Iterable[str]:
        (choice,), (stream,) = choices, streams
        version = max(c.result.policy_version for c in choices)
        body = self.answer.finish(self.st, choices, version)
        for index, item in enumerate(body["output"]):
            if item["type"] == "message":
                yield from self.open_message()
                part = item["content"][0]
                rest = stream.rest(choice.content)
                lps = part.get("logprobs", [])
                if rest or lps[self.sent_logprobs :]:  # deltas add up to the done event
                    tail = lps[self.sent_logprobs :]
                    yield self.event(
                        "response.output_text.delta", delta=rest, logprobs=tail, **self.where()
                    )
                yield self.event(
                    "response.output_text.done", text=part["text"], logprobs=lps, **self.where()
                )
                yield self.event("response.content_part.done", part=part, **self.where())
            else:
                added = dict(item, arguments="", status="in_progress")
                yield self.event("response.output_item.added", output_index=index, item=added)
                at = {"item_id": item["id"], "output_index": index}
                yield self.event(
                    "response.function_call_arguments.delta", delta=item["arguments"], **at
                )
                yield self.event(
                    "response.function_call_arguments.done",
                    name=item["name"],
                    arguments=item["arguments"],
                    **at,
                )
            yield self.event("response.output_item.done", output_index=index, item=item)
        yield self.event(f"response.{body['status']}", response=body)

    def error(self, err: APIError) -> Iterable[str]:
        yield self.event("error", code=err.code, message=err.message, param=err.param)
        failed = {"code": err.code or "server_error", "message": err.message}
        version = self.ctx.sampler.policy_version
        body = self.answer.envelope("failed", [], None, version, error=failed)
        yield self.event("response.failed", response=body)
