"""Incremental streaming: tokens from the sampler to SSE chunks as they decode.

`TokenFeed` carries `on_tokens` calls (from any thread) onto the event loop.
`TextStream` turns the growing token list of one choice into text deltas,
holding back what could still change: a suffix that may be the start of a
stop string or of a tool-call opening, an incomplete UTF-8 character, and
(when tool calls are parsed) surrounding whitespace and everything from the
first tool-call opening on. The concatenated deltas plus `TextStream.rest`
equal the non-streamed content exactly. `WatchedStreamingResponse` notices a
client that goes away while no chunk is being sent and calls `on_close`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.responses import StreamingResponse

from ac2_jax.text import Tokenizer

TOOL_CALL_OPEN = "<tool_call>"  # Hermes; a tokenizer's `tool_parser.block_open` wins


def tool_call_open(tokenizer: Tokenizer) -> str:
    """The text that starts a tool-call block in `tokenizer`'s format."""
    parser = getattr(tokenizer, "tool_parser", None)
    return getattr(parser, "block_open", TOOL_CALL_OPEN)


class TokenFeed:
    """Queue of ("tokens", i, ids, logprobs) and ("done", i) items for one request."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def on_tokens(self, index: int) -> Callable[[list[int], list[float]], None]:
        def feed(ids, logprobs):
            self.loop.call_soon_threadsafe(
                self.queue.put_nowait, ("tokens", index, list(ids), list(logprobs))
            )

        return feed

    def done(self, index: int) -> Callable[[Any], None]:
        return lambda _task: self.queue.put_nowait(("done", index))


def _held_suffix(text: str, patterns: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a pattern."""
    best = 0
    for p in patterns:
        for k in range(min(len(p) - 1, len(text)), best, -1):
            if text.endswith(p[:k]):
                best = k
                break
    return best


class TextStream:
    """Safe text deltas of one choice while its tokens arrive.

    prefix: text already in the assistant turn (a forced tool-call opening).
    """

    def __init__(
        self, tokenizer: Tokenizer, stop: Sequence[str], parse_tools: bool, prefix: str = ""
    ):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.parse_tools = parse_tools
        self.prefix = prefix
        self.open = tool_call_open(tokenizer)
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.sent = ""  # text sent so far
        self.sent_tokens = 0  # tokens whose logprobs were sent
        self.frozen = False  # a stop string or tool call seen: the rest comes at the end

    def push(self, ids: list[int], logprobs: list[float]) -> tuple[str, list[int], list[float]]:
        """Adds tokens; returns (text delta, token ids and logprobs now safe to show)."""
        self.ids += ids
        self.logprobs += logprobs
        if self.frozen:
            return "", [], []
        ids = self.ids
        if ids and ids[-1] in self.tokenizer.stop_token_ids:
            ids = ids[:-1]
        text = self.prefix + self.tokenizer.decode(ids, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stop if s in text]
        if cuts:
            text, self.frozen = text[: min(cuts)], True
        else:
            text = text.rstrip("\ufffd")  # an incomplete UTF-8 character
            held = self.stop + ((self.open,) if self.parse_tools else ())
            text = text[: len(text) - _held_suffix(text, held)]
        if self.parse_tools:
            if self.open in text:
                text, self.frozen = text[: text.find(self.open)], True
            text = text.strip()
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent += delta
        new_ids, new_lps = [], []
        if not cuts:  # no stop string yet: every token so far is kept
            new_ids, new_lps = self.ids[self.sent_tokens :], self.logprobs[self.sent_tokens :]
            self.sent_tokens = len(self.ids)
        return delta, new_ids, new_lps

    def rest(self, content: str | None) -> str:
        """What is left to send of the final `content` (as non-streamed)."""
        content = content or ""
        if not content.startswith(self.sent):
            logging.error(
                "streamed text %r is not a prefix of the final content %r",
                self.sent[:80],
                content[:80],
            )
            return ""
        return content[len(self.sent) :]


class WatchedStreamingResponse(StreamingResponse):
    """A StreamingResponse that listens for the client's disconnect while it
    streams, and always awaits `on_close(completed)` at the end."""

    def __init__(self, content, on_close: Callable[[bool], Awaitable[None]], **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        listen = asyncio.ensure_future(self.listen_for_disconnect(receive))
        completed = False
        try:
            done, _ = await asyncio.wait({stream, listen}, return_when=asyncio.FIRST_COMPLETED)
            if stream in done:
                try:
                    stream.result()
                    completed = True
                except OSError:  # the client went away during a send
                    pass
        finally:
            for task in (stream, listen):
                task.cancel()
            await asyncio.gather(stream, listen, return_exceptions=True)
            await self.on_close(completed)
