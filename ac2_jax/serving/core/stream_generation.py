"""The streaming path of the sampling routes: server-sent events.

`stream_events(ctx, st, writer)` is the one streaming skeleton of every
request API: tokens go out as the sampler accepts them
(`streaming.TextStream`); once sampling ends the choices are finished and
recorded like a plain request, then the rest of each choice (tool calls,
final logprobs), its finish reason and the usage follow. Errors after the
headers are sent are reported in the stream. What the events look like is
the `EventWriter`'s business: `ChunkWriter` writes OpenAI chat / text
completion chunks; the Anthropic Messages and OpenAI Responses routes bring
their own.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable

from ac2_jax.sampling import SampleResult
from ac2_jax.serving.core import chat as chat_lib
from ac2_jax.serving.core.errors import APIError
from ac2_jax.serving.core.sample_run import (
    RequestState,
    ServeContext,
    finish_choices,
    record,
    rollout_failed,
    run_generation,
    sse,
)
from ac2_jax.serving.core.streaming import TextStream


class EventWriter(abc.ABC):
    """How one request API streams: the events around the shared skeleton.

    Each method returns the SSE strings to send (`sample_run.sse` frames one).
    `delta` gets a choice's new visible text and, when logprobs go out with
    the tokens (`incremental_logprobs`), the tokens behind it.
    """

    @abc.abstractmethod
    def opening(self) -> Iterable[str]:
        """Sent before the first token."""

    @abc.abstractmethod
    def delta(self, index: int, text: str, part: SampleResult | None) -> Iterable[str]:
        """New text (and tokens) of choice `index`."""

    @abc.abstractmethod
    def final(self, choices: list, streams: list[TextStream]) -> Iterable[str]:
        """After recording: the rest of each choice (`stream.rest(...)`), tool
        calls, finish reasons, usage and the end of the stream."""

    @abc.abstractmethod
    def error(self, err: APIError) -> Iterable[str]:
        """An error once the headers are out (the stream ends after it)."""


class ChunkWriter(EventWriter):
    """OpenAI chat / text completion chunks for one request."""

    def __init__(self, ctx: ServeContext, st: RequestState):
        self.ctx = ctx
        self.req = st.req
        self.chat = st.chat
        self.cid = st.response_id
        self.created = int(time.time())
        self.kind = "chat.completion.chunk" if st.chat else "text_completion"
        self.version = ctx.sampler.policy_version
        self.offsets = [0] * st.req.n  # text_offset of the next legacy logprob entry
        self.prompt_len = len(st.prompt_ids)

    def chunk(self, choices, usage=None) -> str:
        obj = {
            "id": self.cid,
            "object": self.kind,
            "created": self.created,
            "model": self.ctx.model_name,
            "system_fingerprint": f"policy-{self.version}",
            "choices": choices,
        }
        if self.req.include_usage:
            obj["usage"] = usage
        return sse(obj)

    def piece(self, i, text, part: SampleResult | None, finish=None, extra=None) -> dict:
        req, tokenizer = self.req, self.ctx.tokenizer
        lp = None
        if req.logprobs and part is not None and part.output_ids:
            if self.chat:
                lp = chat_lib.chat_logprobs(tokenizer, part, req.top_logprobs)
            else:
                lp = chat_lib.completion_logprobs(
                    tokenizer, part, req.top_logprobs, self.offsets[i]
                )
                self.offsets[i] += sum(len(t) for t in lp["tokens"])
        if self.chat:
            delta = dict(extra or {})
            if text:
                delta["content"] = text
            return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}

    def opening(self) -> Iterable[str]:
        if self.chat:
            opening = {"role": "assistant", "content": ""}
            yield self.chunk([self.piece(i, "", None, extra=opening) for i in range(self.req.n)])

    def delta(self, index: int, text: str, part: SampleResult | None) -> Iterable[str]:
        yield self.chunk([self.piece(index, text, part)])

    def final(self, choices: list, streams: list[TextStream]) -> Iterable[str]:
        return final_chunks(self, choices, streams)

    def error(self, err: APIError) -> Iterable[str]:
        yield sse(err.body())


def incremental_logprobs(req) -> bool:
    """Whether logprobs go out with the tokens. on_tokens carries no top-logprobs:
    with top_logprobs > 0 every entry comes with the final result instead."""
    return bool(req.logprobs and req.top_logprobs == 0)


async def stream_tokens(
    st: RequestState, out: EventWriter, streams: list[TextStream]
) -> AsyncIterator[str]:
    """Chunks of the tokens as they arrive, until every sample is done."""
    incremental_lps = incremental_logprobs(st.req)
    feed = st.gen.feed
    assert feed is not None
    pending = st.req.n
    while pending:
        items = [await feed.queue.get()]
        while not feed.queue.empty():  # coalesce what is already waiting
            items.append(feed.queue.get_nowait())
        new: dict[int, tuple[list, list]] = {}
        for item in items:
            if item[0] == "done":
                pending -= 1
            else:
                ids, lps = new.setdefault(item[1], ([], []))
                ids += item[2]
                lps += item[3]
        for i, (ids, lps) in sorted(new.items()):
            # Decoding grows with the text: in a worker thread, off the event loop.
            text, shown, shown_lps = await asyncio.to_thread(streams[i].push, ids, lps)
            part = (
                SampleResult(shown, shown_lps, "length", 0) if incremental_lps and shown else None
            )
            if text or part is not None:
                for event in out.delta(i, text, part):
                    yield event


def final_chunks(out: ChunkWriter, choices, streams: list[TextStream]):
    """The rest of each choice, its finish reason, the usage and [DONE]."""
    req, chat = out.req, out.chat
    incremental_lps = incremental_logprobs(req)
    out.version = max(c.result.policy_version for c in choices)
    for c, s in zip(choices, streams, strict=True):
        r, k = c.result, (s.sent_tokens if incremental_lps else 0)
        part = SampleResult(
            r.output_ids[k:],
            r.output_logprobs[k:],
            "length",
            0,
            top_logprobs=r.top_logprobs[k:] if r.top_logprobs else None,
        )
        text = s.rest(c.content if chat else c.text)
        extra = (
            {"tool_calls": [{"index": j, **call} for j, call in enumerate(c.tool_calls)]}
            if chat and c.tool_calls
            else None
        )
        if text or extra or (req.logprobs and part.output_ids):
            yield out.chunk([out.piece(c.index, text, part, extra=extra)])
        yield out.chunk([out.piece(c.index, "", None, finish=c.finish_reason)])
    if req.include_usage:
        yield out.chunk([], chat_lib.usage(out.prompt_len, [c.result for c in choices]))
    yield "data: [DONE]\n\n"


async def stream_events(
    ctx: ServeContext, st: RequestState, out: EventWriter | None = None
) -> AsyncIterator[str]:
    """The whole event stream of one streaming request (OpenAI chunks unless
    another `EventWriter` is given)."""
    req, gen = st.req, st.gen
    out = out if out is not None else ChunkWriter(ctx, st)
    streams = [TextStream(ctx.tokenizer, req.stop, st.parse_tools, st.prefix) for _ in range(req.n)]
    for event in out.opening():
        yield event
    async for event in stream_tokens(st, out, streams):
        yield event
    try:
        results = await run_generation(ctx, st.principal, gen)
        choices, turns = await asyncio.to_thread(finish_choices, ctx, results, st)
        gen.settled = True  # done sampling: recorded even if the client leaves now
        await record(ctx, st, choices, time.monotonic() - st.t0, turns)
    except APIError as e:
        gen.settled = True
        for event in out.error(e):
            yield event
        return
    except Exception as e:  # noqa: BLE001 - headers are out: report in the stream
        gen.settled = True
        logging.exception("a streamed request failed")
        await rollout_failed(ctx, st.principal, e, counter="server_errors")
        for event in out.error(APIError(500, "Internal server error", code="internal_error")):
            yield event
        return
    for event in out.final(choices, streams):
        yield event
