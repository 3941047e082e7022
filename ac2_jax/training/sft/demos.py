"""Demonstration conversations -> SFT segments, tokenized as the endpoint would.

A demo is a list of OpenAI messages. Its tokens are the chat template's
rendering, cut at message boundaries (which fall on special tokens, so
piecewise encoding equals whole encoding); loss mask 1 exactly on what the
model would emit for each assistant turn: its content and tool calls up to
and including the end-of-turn token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ac2_jax.segments import Segment


def demo_segment(
    tokenizer,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    task: str = "demo",
    agent: str = "main",
) -> Segment:
    """One segment for one demo conversation (loss on assistant outputs), labelled
    with the `agent` that speaks in it (per-agent SFT figures read the label)."""
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
