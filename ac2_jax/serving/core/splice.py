"""Token-in / token-out: reuse the exact sampled ids of earlier assistant turns.

A client sends its whole conversation back each turn, with our earlier
answers as text. Re-tokenizing that text can give different ids than the ones
the model sampled (BPE merges across boundaries, JSON re-serialization of tool
arguments, trimmed stop strings, template rewrites), and then the new prompt
no longer extends the old prompt + output, so an append-only conversation
would break into episodes. Instead, `TurnMemory` remembers the sampled ids
of every assistant turn we produced (keyed by the content and tool calls we
returned), and `build_prompt_ids` renders the chat with a unique sentinel as
the content of each remembered turn, tokenizes the text between sentinels,
and splices the sampled ids in place of each sentinel. When the sampled ids
end with a stop token that the template writes right after the turn, the
template's copy is skipped. Text around the sentinels is tokenized piece by
piece, split exactly where the earlier prompts ended, so every prompt extends
the previous prompt + output token for token as long as the template renders
earlier messages the same way each time.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

from ac2_jax.text.tokenizer import Tokenizer

_SENTINEL = "\ue000ac2turn{}\ue001"  # private-use chars: never in real text


def _canonical_args(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments, sort_keys=True, ensure_ascii=False)


def turn_key(content: str | None, tool_calls: Sequence[dict] | None, strip: bool = True) -> tuple:
    """What identifies an assistant turn the client sends back (ids ignored): the
    content (whitespace-stripped unless strip=False) and the calls' canonical JSON."""
    calls = []
    for call in tool_calls or ():
        fn = call.get("function", call)
        calls.append((fn.get("name"), _canonical_args(fn.get("arguments", {}))))
    text = content or ""
    return (text.strip() if strip else text, tuple(calls))


class TurnMemory:
    """Sampled ids of the assistant turns of one rollout. Thread-safe.

    Each turn is kept under its exact text and under its whitespace-stripped text;
    a lookup tries the exact text first. So two turns that differ only in
    surrounding whitespace ("\n<tool_call>" and "<tool_call>\n") keep their own
    ids, and a client that strips what it sends back still finds the turn (the
    latest one of that stripped text)."""

    def __init__(self):
        self._turns: dict[tuple, list[int]] = {}  # by stripped text
        self._exact: dict[tuple, list[int]] = {}  # by exact text
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._turns)

    def remember(
        self, content: str | None, tool_calls: Sequence[dict] | None, output_ids: Sequence[int]
    ) -> None:
        if not output_ids:
            return
        ids = [int(t) for t in output_ids]
        with self._lock:
            self._exact[turn_key(content, tool_calls, strip=False)] = ids
            self._turns[turn_key(content, tool_calls)] = ids

    def lookup(self, message: dict) -> list[int] | None:
        if message.get("role") != "assistant":
            return None
        content, calls = message.get("content"), message.get("tool_calls")
        with self._lock:
            exact = self._exact.get(turn_key(content, calls, strip=False))
            return exact if exact is not None else self._turns.get(turn_key(content, calls))


def _rendered_ids(
    tokenizer: Tokenizer, messages: Sequence[dict], tools: Sequence[dict] | None
) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True)
    if isinstance(ids, str):
        raise TypeError("apply_chat_template(tokenize=True) returned text, not token ids")
    return list(ids)


def build_prompt_ids(
    tokenizer: Tokenizer,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    memory: TurnMemory | None = None,
) -> tuple[list[int], int]:
    """Prompt ids for `messages` (+ generation prompt), with remembered turns spliced.

    Returns (prompt_ids, number of spliced turns). Falls back to plain
    rendering when the template drops or repeats a turn's content.
    """
    spliced: dict[int, list[int]] = {}
    if memory is not None:
        for i, m in enumerate(messages):
            remembered = memory.lookup(m)
            if remembered:
                spliced[i] = remembered
    if not spliced:
        return _rendered_ids(tokenizer, messages, tools), 0
    msgs = [dict(m) for m in messages]
    for i in spliced:
        msgs[i] = {"role": "assistant", "content": _SENTINEL.format(i)}
    text = tokenizer.apply_chat_template(msgs, tools=tools)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template returned {type(text).__name__}, not text")
    ids: list[int] = []
    pos = 0
    for i in sorted(spliced):
        mark = _SENTINEL.format(i)
        at = text.find(mark, pos)
        if at < 0 or text.count(mark) != 1:
            return _rendered_ids(tokenizer, messages, tools), 0
        ids += tokenizer.encode(text[pos:at])
        ids += spliced[i]
        pos = at + len(mark)
        last = spliced[i][-1]
        if last in tokenizer.stop_token_ids:
            stop_text = tokenizer.decode([last])
            if stop_text and text.startswith(stop_text, pos):
                pos += len(stop_text)
    ids += tokenizer.encode(text[pos:])
    return ids, len(spliced)
