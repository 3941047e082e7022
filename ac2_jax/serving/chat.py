"""OpenAI request parsing and response building (chat and text completions).

Parsing turns a JSON body into a validated request with clear 400s naming the
bad field; `choice_from_result` turns one `SampleResult` into the text the
client sees (stop strings cut, EOS dropped, Hermes tool calls parsed).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any

from ac2_jax.models.tokenizer import Tokenizer, parse_tool_calls
from ac2_jax.sampling import SampleResult
from ac2_jax.serving.errors import bad_request

ROLES = ("system", "developer", "user", "assistant", "tool")
_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")


@dataclasses.dataclass
class GenerationRequest:
    """The sampling part shared by chat and text completions."""

    model: str
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    agent: str | None = None


@dataclasses.dataclass
class ChatRequest(GenerationRequest):
    messages: list[dict] = dataclasses.field(default_factory=list)
    tools: list[dict] | None = None
    tool_choice: Any = None


@dataclasses.dataclass
class CompletionRequest(GenerationRequest):
    prompt: str | list[int] = ""


def _get(body: dict, key: str, types, default=None, check=None, what=""):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad_request(f"'{key}' must be {what or types}, got {value!r}", param=key)
    if not isinstance(value, types):
        raise bad_request(f"'{key}' must be {what or getattr(types, '__name__', types)}, "
                          f"got {type(value).__name__}", param=key)
    if check is not None and not check(value):
        raise bad_request(f"'{key}' is out of range: {what}, got {value!r}", param=key)
    return value


def _parse_common(body: Any, cls, **extra):
    if not isinstance(body, dict):
        raise bad_request(f"Request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required (a string naming the served model)", param="model")
    max_tokens = _get(body, "max_completion_tokens", int, None, lambda v: v >= 1, "an int >= 1")
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int, None, lambda v: v >= 1, "an int >= 1")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= 16:
        stop = tuple(stop)
    else:
        raise bad_request("'stop' must be a string or a list of up to 16 non-empty strings",
                          param="stop")
    logprobs = body.get("logprobs")
    top_logprobs = _get(body, "top_logprobs", int, 0, lambda v: 0 <= v <= 20, "an int in [0, 20]")
    if cls is CompletionRequest and logprobs is not None and not isinstance(logprobs, bool):
        # Legacy completions: `logprobs` is the number of top tokens.
        if not isinstance(logprobs, int) or not 0 <= logprobs <= 20:
            raise bad_request("'logprobs' must be an int in [0, 20]", param="logprobs")
        top_logprobs, logprobs = logprobs, True
    elif logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request("'logprobs' must be a boolean", param="logprobs")
    stream_options = _get(body, "stream_options", dict, {})
    metadata = _get(body, "metadata", dict, {})
    agent = metadata.get("agent") or body.get("user")
    if agent is not None and not isinstance(agent, str):
        raise bad_request("'metadata.agent' / 'user' must be a string", param="user")
    return cls(
        model=model,
        n=_get(body, "n", int, 1, lambda v: 1 <= v <= 64, "an int in [1, 64]"),
        max_tokens=max_tokens,
        temperature=float(_get(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2,
                               "a number in [0, 2]")),
        top_p=float(_get(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1,
                         "a number in (0, 1]")),
        top_k=_get(body, "top_k", int, -1),
        stop=stop,
        seed=_get(body, "seed", int, None),
        logprobs=bool(logprobs) or top_logprobs > 0,
        top_logprobs=top_logprobs,
        stream=bool(_get(body, "stream", bool, False)),
        include_usage=bool(stream_options.get("include_usage", False)),
        agent=agent or None,
        **extra,
    )


def _text_content(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(
                    part.get("text"), str):
                parts.append(part["text"])
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"{where}.content: only text parts are supported, got {kind!r}",
                                  param=f"{where}.content")
        return "\n".join(parts)
    raise bad_request(f"{where}.content must be a string or a list of text parts",
                      param=f"{where}.content")


def normalize_messages(messages: Any) -> list[dict]:
    """Validated OpenAI messages as plain dicts with string content."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", param=where)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {list(ROLES)}, got {role!r}",
                              param=f"{where}.role")
        msg = {k: m[k] for k in _MESSAGE_KEYS if m.get(k) is not None}
        msg["role"] = "system" if role == "developer" else role
        content = _text_content(m.get("content"), where)
        if content is not None:
            msg["content"] = content
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise bad_request(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise bad_request(f"{where}.tool_calls[{j}].function.name is required",
                                      param=f"{where}.tool_calls")
            if content is None and not calls:
                raise bad_request(f"{where}: an assistant message needs content or tool_calls",
                                  param=f"{where}.content")
            if calls:
                msg["tool_calls"] = calls
        elif content is None:
            raise bad_request(f"{where}.content is required for role {role!r}",
                              param=f"{where}.content")
        out.append(msg)
    return out


def parse_chat_request(body: Any) -> ChatRequest:
    req = _parse_common(body, ChatRequest)
    req.messages = normalize_messages(body.get("messages"))
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and isinstance(t.get("function", {}).get("name"), str)
                for t in tools):
            raise bad_request("'tools' must be a list of {type: function, function: {name, ...}}",
                              param="tools")
        req.tools = tools or None
    req.tool_choice = body.get("tool_choice")
    return req


def parse_completion_request(body: Any) -> CompletionRequest:
    req = _parse_common(body, CompletionRequest)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        req.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        req.prompt = prompt
    else:
        raise bad_request("'prompt' must be a non-empty string or list of token ids "
                          "(batches of several prompts are not supported)", param="prompt")
    unsupported = {"echo": bool(body.get("echo")), "suffix": bool(body.get("suffix")),
                   "best_of": body.get("best_of") is not None and body.get("best_of") != 1
                   or isinstance(body.get("best_of"), bool)}
    for key, used in unsupported.items():
        if used:
            raise bad_request(f"'{key}' is not supported", param=key)
    return req


# ---------------------------------------------------------------------------- responses

@dataclasses.dataclass
class Choice:
    """What the client sees of one sampled result."""

    index: int
    text: str                       # visible text (stop string and EOS removed)
    content: str | None             # chat content after tool-call parsing
    tool_calls: list[dict]
    finish_reason: str              # stop | length | tool_calls
    result: SampleResult


def choice_from_result(index: int, result: SampleResult, matched_stop: str | None,
                       tokenizer: Tokenizer, parse_tools: bool) -> Choice:
    ids = result.output_ids
    if ids and result.finish_reason == "stop" and ids[-1] in tokenizer.stop_token_ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if matched_stop is not None and matched_stop in text:
        text = text[: text.find(matched_stop)]
    content, calls = (parse_tool_calls(text) if parse_tools else (text, []))
    finish = "tool_calls" if calls and result.finish_reason == "stop" else result.finish_reason
    return Choice(index, text, content if (content or not calls) else None, calls, finish, result)


def _token_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict:
    s = tokenizer.decode([token_id])
    return {"token": s, "logprob": float(logprob), "bytes": list(s.encode("utf-8"))}


def chat_logprobs(tokenizer: Tokenizer, result: SampleResult, top_n: int) -> dict:
    """OpenAI `choice.logprobs` for every sampled token (the stop token included)."""
    content = []
    for i, (tid, lp) in enumerate(zip(result.output_ids, result.output_logprobs)):
        entry = _token_entry(tokenizer, tid, lp)
        tops = (result.top_logprobs or [[]] * len(result.output_ids))[i][:top_n]
        entry["top_logprobs"] = [_token_entry(tokenizer, t, l) for t, l in tops]
        content.append(entry)
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: Tokenizer, result: SampleResult, top_n: int) -> dict:
    """Legacy completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [tokenizer.decode([t]) for t in result.output_ids]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    tops = None
    if top_n and result.top_logprobs is not None:
        tops = [{tokenizer.decode([t]): float(l) for t, l in row[:top_n]}
                for row in result.top_logprobs]
    return {"tokens": tokens, "token_logprobs": [float(x) for x in result.output_logprobs],
            "top_logprobs": tops, "text_offset": offsets}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_len: int, results: list[SampleResult]) -> dict:
    completion = sum(len(r.output_ids) for r in results)
    return {"prompt_tokens": prompt_len, "completion_tokens": completion,
            "total_tokens": prompt_len + completion,
            "prompt_tokens_details": {"cached_tokens": max((r.cached_tokens for r in results),
                                                           default=0)}}


def chat_message(choice: Choice) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": choice.content}
    if choice.tool_calls:
        msg["tool_calls"] = choice.tool_calls
    return msg


def chat_response(model: str, choices: list[Choice], prompt_len: int, tokenizer: Tokenizer,
                  req: ChatRequest, policy_version: int) -> dict:
    out = []
    for c in choices:
        item = {"index": c.index, "message": chat_message(c), "finish_reason": c.finish_reason,
                "logprobs": (chat_logprobs(tokenizer, c.result, req.top_logprobs)
                             if req.logprobs else None)}
        out.append(item)
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": out,
            "usage": usage(prompt_len, [c.result for c in choices]),
            "system_fingerprint": f"policy-{policy_version}", "policy_version": policy_version}


def chat_stream_events(model: str, choices: list[Choice], prompt_len: int,
                       tokenizer: Tokenizer, req: ChatRequest, policy_version: int):
    """SSE lines of a streamed chat completion (sent once sampling is done)."""
    cid, created = new_id("chatcmpl"), int(time.time())

    def chunk(delta_choices, usage_obj=None):
        obj = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
               "system_fingerprint": f"policy-{policy_version}", "choices": delta_choices}
        if req.include_usage:
            obj["usage"] = usage_obj
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    for c in choices:
        yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}])
        if c.content:
            lp = chat_logprobs(tokenizer, c.result, req.top_logprobs) if req.logprobs else None
            yield chunk([{"index": c.index, "delta": {"content": c.content}, "logprobs": lp,
                          "finish_reason": None}])
        for j, call in enumerate(c.tool_calls):
            delta = {"tool_calls": [{"index": j, **call}]}
            yield chunk([{"index": c.index, "delta": delta, "logprobs": None,
                          "finish_reason": None}])
        yield chunk([{"index": c.index, "delta": {}, "logprobs": None,
                      "finish_reason": c.finish_reason}])
    if req.include_usage:
        yield chunk([], usage(prompt_len, [c.result for c in choices]))
    yield "data: [DONE]\n\n"


def completion_response(model: str, choices: list[Choice], prompt_len: int,
                        tokenizer: Tokenizer, req: CompletionRequest,
                        policy_version: int) -> dict:
    out = [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
            "logprobs": (completion_logprobs(tokenizer, c.result, req.top_logprobs)
                         if req.logprobs else None)} for c in choices]
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": out,
            "usage": usage(prompt_len, [c.result for c in choices]),
            "system_fingerprint": f"policy-{policy_version}", "policy_version": policy_version}


def completion_stream_events(model: str, choices: list[Choice], prompt_len: int,
                             tokenizer: Tokenizer, req: CompletionRequest, policy_version: int):
    cid, created = new_id("cmpl"), int(time.time())
    for c in choices:
        lp = completion_logprobs(tokenizer, c.result, req.top_logprobs) if req.logprobs else None
        obj = {"id": cid, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": c.index, "text": c.text, "logprobs": lp,
                            "finish_reason": c.finish_reason}]}
        yield f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
    if req.include_usage:
        obj = {"id": cid, "object": "text_completion", "created": created, "model": model,
               "choices": [], "usage": usage(prompt_len, [c.result for c in choices])}
        yield f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"
