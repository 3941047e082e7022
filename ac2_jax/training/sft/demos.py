"""Demonstration conversations -> SFT segments, tokenized as the endpoint would.

A demo is a list of OpenAI messages. Its tokens are the chat template's
rendering, cut at message boundaries (which fall on special tokens, so
piecewise encoding equals whole encoding); loss mask 1 exactly on what the
model would emit for each assistant turn: its content and tool calls up to
and including the end-of-turn token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from ac2_jax.segments import Segment


def _calls(calls) -> list[tuple[Any, Any]]:
    """(name, arguments as an object where they read as one) of OpenAI tool calls."""
    out = []
    for c in calls or []:
        fn = c.get("function", {}) if isinstance(c, dict) else {}
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append((fn.get("name"), args))
    return out


def demo_segment(
    tokenizer,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    task: str = "demo",
    agent: str = "main",
    problems: list[str] | None = None,
) -> Segment:
    """One segment for one demo conversation (loss on assistant outputs), labelled
    with the `agent` that speaks in it (per-agent SFT figures read the label).

    problems: when a list, each assistant turn's rendered output (what the model is
    trained to emit) is read back by the tokenizer's tool-call parser, and a turn
    whose calls do not come back (names and arguments) is described there: the chat
    template dropped them, or the model's format is not the parser's.
    """
    eos = tokenizer.eos_token
    full = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(
            tokenizer.apply_chat_template(messages[:i], tools=tools, add_generation_prompt=True)
        )
        rendered = tokenizer.apply_chat_template(
            messages[: i + 1], tools=tools, add_generation_prompt=False
        )
        end = rendered.rindex(eos) + len(eos)
        if full[:end] != rendered[:end]:
            raise ValueError(
                f"demo_segment: the template does not render message {i} "
                "append-only; cannot cut it into turns"
            )
        spans.append((start, end))
        if problems is not None and hasattr(tokenizer, "parse_tool_calls"):
            want = _calls(m.get("tool_calls"))
            text = full[start:end].removesuffix(eos)
            got = _calls(tokenizer.parse_tool_calls(text, tools).calls)
            if got != want:
                parser = getattr(getattr(tokenizer, "tool_parser", None), "name", "?")
                problems.append(
                    f"demo {task!r} message {i}: its tool calls {[n for n, _ in want]} render "
                    f"as text the tool-call parser ({parser}) reads as {[n for n, _ in got]}"
                    f"{'' if [n for n, _ in got] != [n for n, _ in want] else ' (other arguments)'}"
                )
    if not spans:
        raise ValueError("demo_segment: the demo has no assistant message to train on")
    tokens, mask, pos = [], [], 0
    for start, end in spans:
        prompt = tokenizer.encode(full[pos:start]) if start > pos else []
        output = tokenizer.encode(full[start:end])
        tokens += prompt + output
        mask += [0] * len(prompt) + [1] * len(output)
        pos = end
    return Segment(np.array(tokens), np.array(mask, np.float32), task=task, agent=agent)
