"""OpenAI responses (chat and text completions) from sampled results.

`choice_from_result` turns one `SampleResult` into the text the client sees
(stop strings cut, EOS dropped, Hermes tool calls parsed); the request side
is in `requests`, incremental streaming in `streaming`. A turn is text or
tool calls with no markup in its content: one that `max_tokens` cut inside a
call ("length") did not parse, so all of it is text and none of it a call.
Every API (chat, Messages, Responses; streamed or not) answers from this
`Choice`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from ac2_jax.sampling import SampleResult
from ac2_jax.serving.core.requests import ChatRequest, CompletionRequest
from ac2_jax.serving.core.streaming import tool_call_open
from ac2_jax.text import Tokenizer

# ---------------------------------------------------------------------------- responses


@dataclasses.dataclass
class Choice:
    """What the client sees of one sampled result."""

    index: int
    text: str  # visible text (stop string and EOS removed)
    content: str | None  # chat content after tool-call parsing
    tool_calls: list[dict]
    finish_reason: str  # stop | length | tool_calls
    result: SampleResult
    malformed_tool_calls: int = 0  # tool-call blocks that did not parse (left in content)


def choice_from_result(
    index: int,
    result: SampleResult,
    matched_stop: str | None,
    tokenizer: Tokenizer,
    parse_tools: bool,
    prefix: str = "",
) -> Choice:
    """prefix: text that opened the assistant turn before sampling (a forced
    tool-call opening); it is part of the text the tool calls are parsed from."""
    ids = result.output_ids
    if ids and result.finish_reason == "stop" and ids[-1] in tokenizer.stop_token_ids:
        ids = ids[:-1]
    text = prefix + tokenizer.decode(ids, skip_special_tokens=True)
    if matched_stop is not None and matched_stop in text:
        text = text[: text.find(matched_stop)]
    parsed = tokenizer.parse_tool_calls(text) if parse_tools else (text, [])
    content, calls = parsed
    malformed = int(getattr(parsed, "malformed", 0))
    if calls and result.finish_reason == "length" and _cut_in_a_call(content, malformed, tokenizer):
        # The budget ran out inside a tool call: the turn did not parse, so it is
        # text (as sampled: a client that sends it back renders the same tokens),
        # never calls beside the raw markup of the cut one.
        content, calls = text.strip(), []
    finish = "tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason
    return Choice(
        index,
        text,
        content if (content or not calls) else None,
        calls,
        finish,
        result,
        malformed,
    )


def _cut_in_a_call(content: str, malformed: int, tokenizer: Tokenizer) -> bool:
    """Whether a parsed turn left tool-call markup behind: a block that did not
    parse (an unclosed one: the cut), or content ending in part of a block opening."""
    if malformed:
        return True
    opening = tool_call_open(tokenizer)
    tail = content.rstrip()
    return any(tail.endswith(opening[:k]) for k in range(1, len(opening)))


def _token_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict:
    s = tokenizer.decode([token_id])
    return {"token": s, "logprob": float(logprob), "bytes": list(s.encode("utf-8"))}


def chat_logprobs(tokenizer: Tokenizer, result: SampleResult, top_n: int) -> dict:
    """OpenAI `choice.logprobs` for every sampled token (the stop token included)."""
    content = []
    for i, (tid, lp) in enumerate(zip(result.output_ids, result.output_logprobs, strict=True)):
        entry = _token_entry(tokenizer, tid, lp)
        tops = (result.top_logprobs or [[]] * len(result.output_ids))[i][:top_n]
        entry["top_logprobs"] = [_token_entry(tokenizer, t, lp) for t, lp in tops]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokenizer: Tokenizer, result: SampleResult, top_n: int, offset: int = 0
) -> dict:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset
    (counted from `offset`: the characters of tokens already sent when streaming)."""
    tokens = [tokenizer.decode([t]) for t in result.output_ids]
    offsets, pos = [], offset
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    tops = None
    if top_n and result.top_logprobs is not None:
        tops = [
            {tokenizer.decode([t]): float(lp) for t, lp in row[:top_n]}
            for row in result.top_logprobs
        ]
    return {
        "tokens": tokens,
        "token_logprobs": [float(x) for x in result.output_logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_len: int, results: list[SampleResult]) -> dict:
    completion = sum(len(r.output_ids) for r in results)
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
        "prompt_tokens_details": {
            "cached_tokens": max((r.cached_tokens for r in results), default=0)
        },
    }


def chat_message(choice: Choice) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": choice.content}
    if choice.tool_calls:
        msg["tool_calls"] = choice.tool_calls
    return msg


def chat_response(
    model: str,
    choices: list[Choice],
    prompt_len: int,
    tokenizer: Tokenizer,
    req: ChatRequest,
    policy_version: int,
    response_id: str | None = None,
) -> dict:
    out = []
    for c in choices:
        item = {
            "index": c.index,
            "message": chat_message(c),
            "finish_reason": c.finish_reason,
            "logprobs": (
                chat_logprobs(tokenizer, c.result, req.top_logprobs) if req.logprobs else None
            ),
        }
        out.append(item)
    return {
        "id": response_id or new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": usage(prompt_len, [c.result for c in choices]),
        "system_fingerprint": f"policy-{policy_version}",
        "policy_version": policy_version,
    }


def completion_response(
    model: str,
    choices: list[Choice],
    prompt_len: int,
    tokenizer: Tokenizer,
    req: CompletionRequest,
    policy_version: int,
    response_id: str | None = None,
) -> dict:
    out = [
        {
            "index": c.index,
            "text": c.text,
            "finish_reason": c.finish_reason,
            "logprobs": (
                completion_logprobs(tokenizer, c.result, req.top_logprobs) if req.logprobs else None
            ),
        }
        for c in choices
    ]
    return {
        "id": response_id or new_id("cmpl"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": usage(prompt_len, [c.result for c in choices]),
        "system_fingerprint": f"policy-{policy_version}",
        "policy_version": policy_version,
    }
