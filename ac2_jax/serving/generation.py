"""The sampling routes: POST /v1/chat/completions and POST /v1/completions.

Each request runs its `n` samples as tasks; a rollout's samples carry its id
as their `route_key` (a `FleetSampler` keeps one rollout on one backend).
Rendering, tokenization, tool-call parsing and recording run in worker
threads, never on the event loop. A client that goes away (streaming or not)
cancels its samples and records nothing trainable: the rollout counts it in
`aborted_completions`. A `SamplerError` is a 503 and ends the rollout as
`infra_error`. Streaming sends tokens as the sampler accepts them
(`streaming.TextStream`).

tool_choice "required" / {"function": {"name"}} forces a call by writing
the tool-call opening (`<tool_call>\\n`, plus `{"name": ..., "arguments": `
for a named one) at the start of the assistant turn: those tokens go to the
prompt (loss mask 0), the model writes the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ac2_jax.models import Tokenizer
from ac2_jax.sampling import (
    ContextLengthError,
    Sampler,
    SamplerError,
    SampleResult,
    SamplingParams,
    route_key,
    truncate_at_stop,
)
from ac2_jax.serving import chat as chat_lib
from ac2_jax.serving import requests as req_lib
from ac2_jax.serving.errors import APIError, bad_request
from ac2_jax.serving.rollouts import RolloutRegistry
from ac2_jax.serving.splice import build_prompt_ids
from ac2_jax.serving.streaming import (
    TOOL_CALL_OPEN,
    TextStream,
    TokenFeed,
    WatchedStreamingResponse,
)
from ac2_jax.trace import Completion

AGENT_HEADER = "x-agent"


def forced_prefix(tokenizer: Tokenizer, req: req_lib.ChatRequest) -> str:
    """Text that opens the assistant turn to force a tool call ("" if none), in
    the tokenizer's tool-call format (`tool_parser.opening` / `named_opening`)."""
    parser = getattr(tokenizer, "tool_parser", None)
    if req.tool_choice == "required":
        return parser.opening if parser is not None else TOOL_CALL_OPEN + "\n"
    if req.forced_tool is not None:
        if parser is not None:
            return parser.named_opening(req.forced_tool)
        return TOOL_CALL_OPEN + "\n" + '{"name": ' + json.dumps(req.forced_tool) + ', "arguments": '
    return ""


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Generation:
    """The `n` sampling tasks of one request, and what became of them."""

    def __init__(
        self,
        sampler: Sampler,
        prompt_ids: list[int],
        params: list[SamplingParams],
        feed: TokenFeed | None,
        route: str | None = None,
    ):
        self.feed = feed
        self.tasks = []
        with route_key(route):  # each task keeps the key it was created with
            for i, p in enumerate(params):
                on_tokens = feed.on_tokens(i) if feed is not None else None
                task = asyncio.ensure_future(sampler.generate(prompt_ids, p, on_tokens=on_tokens))
                if feed is not None:
                    task.add_done_callback(feed.done(i))
                self.tasks.append(task)
        self.settled = False  # recorded, or failed with an error already reported

    def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()

    async def results(self):
        try:
            return await asyncio.gather(*self.tasks)
        except BaseException:
            self.cancel()
            raise


def install_generation_routes(
    app: FastAPI,
    *,
    sampler: Sampler,
    tokenizer: Tokenizer,
    registry: RolloutRegistry,
    model_name: str,
    default_max_tokens: int | None,
    authenticate: Callable,
    read_json: Callable,
) -> None:
    """Adds the two sampling routes to `app` (see the module docstring)."""

    def check_model(name: str) -> None:
        if name != model_name:
            raise APIError(
                404,
                f"The model {name!r} does not exist; this server serves {model_name!r}",
                param="model",
                code="model_not_found",
            )

    def agent_label(request: Request, req: req_lib.GenerationRequest) -> str:
        agent = request.headers.get(AGENT_HEADER) or req.agent or "main"
        if len(agent) > req_lib.MAX_AGENT_LEN:
            raise bad_request(
                f"agent label is longer than {req_lib.MAX_AGENT_LEN} characters", param="X-Agent"
            )
        return agent

    def sampling_params(prompt_len: int, req: req_lib.GenerationRequest) -> list[SamplingParams]:
        max_context = sampler.max_context
        if prompt_len >= max_context:
            raise bad_request(
                f"This model's maximum context length is {max_context} tokens, but the prompt "
                f"has {prompt_len} tokens (and at least one output token is needed)",
                param="messages",
                code="context_length_exceeded",
            )
        room = max_context - prompt_len
        max_tokens = min(req.max_tokens or default_max_tokens or room, room)
        try:
            base = SamplingParams(
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                max_tokens=max_tokens,
                stop=req.stop,
                stop_token_ids=tokenizer.stop_token_ids,
                seed=req.seed,
                top_logprobs=req.top_logprobs,
            )
            return [
                base if req.seed is None else base.replace(seed=req.seed + i) for i in range(req.n)
            ]
        except ValueError as e:  # the request's fields were checked by `schemas` already
            raise bad_request(f"The sampling parameters were refused: {e}") from None

    async def run(request: Request, principal, gen: Generation, rollout_failed: Callable):
        """The samples, with errors mapped; a SamplerError ends the rollout (503)."""
        try:
            return await gen.results()
        except ContextLengthError as e:
            raise bad_request(str(e), param="messages", code="context_length_exceeded") from None
        except SamplerError as e:
            logging.warning("sampler failed a request: %s", e)
            await rollout_failed(principal, e)
            raise APIError(
                503,
                "The sampler failed this request; the rollout ends as "
                "infra_error. Retrying in a new rollout may succeed",
                code="sampler_error",
            ) from None
        except ValueError as e:
            raise bad_request(f"The sampler rejected the request: {e}") from None

    async def rollout_failed(principal, exc: Exception, counter: str = "sampler_errors"):
        """Our fault: counted, and the rollout ends as infra_error (never trained)."""
        rollout = principal.rollout
        if rollout is None:
            return
        registry.count(rollout, counter)
        if rollout.running:
            with contextlib.suppress(APIError):
                await asyncio.to_thread(
                    registry.finish,
                    rollout,
                    status="infra_error",
                    artifacts={"error": f"{type(exc).__name__}: {exc}"},
                )

    def finish_choices(results, req, parse_tools: bool, prefix: str, prefix_ids: list[int]):
        cut = [truncate_at_stop(r, req.stop, tokenizer.decode) for r in results]
        choices = [
            chat_lib.choice_from_result(i, r, m, tokenizer, parse_tools, prefix=prefix)
            for i, (r, m) in enumerate(cut)
        ]
        turns = [(c.content, c.tool_calls, prefix_ids + list(c.result.output_ids)) for c in choices]
        return choices, turns

    async def record(
        principal, agent, req, prompt_ids, choices, elapsed, messages, turns, response_id: str
    ):
        """Records the request's n choices, each with the response id the client sees
        and its choice index (how RL knows which response a harness continued)."""
        if principal.rollout is None:
            return
        comps = [
            Completion(
                prompt_ids=list(prompt_ids),
                output_ids=list(c.result.output_ids),
                output_logprobs=[float(x) for x in c.result.output_logprobs],
                policy_version=int(c.result.policy_version),
                finish_reason=c.finish_reason,
                timings={"sample_s": elapsed},
                cached_tokens=int(c.result.cached_tokens),
                messages=messages,
                temperature=float(req.temperature),
                top_k=int(req.top_k),
                top_p=float(req.top_p),
                request_id=response_id,
                choice_index=int(c.index),
            )
            for c in choices
        ]
        await asyncio.to_thread(registry.record, principal.rollout, agent, comps, list(turns))
        malformed = sum(c.malformed_tool_calls for c in choices)
        if malformed:
            registry.count(principal.rollout, "malformed_tool_calls", malformed)

    async def until_disconnect(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def serve(
        request: Request,
        principal,
        req,
        agent: str,
        prompt_ids: list[int],
        messages: list[dict] | None,
        chat: bool,
    ):
        parse_tools = chat and req.parse_tools
        prefix = forced_prefix(tokenizer, req) if chat else ""
        prefix_ids = await asyncio.to_thread(tokenizer.encode, prefix) if prefix else []
        full_prompt = list(prompt_ids) + prefix_ids
        params = sampling_params(len(full_prompt), req)
        route = principal.rollout.rollout_id if principal.rollout is not None else None
        response_id = chat_lib.new_id("chatcmpl" if chat else "cmpl")
        t0 = time.monotonic()

        def abort():
            gen.cancel()
            if principal.rollout is not None:
                registry.count(principal.rollout, "aborted_completions", req.n)

        if req.stream:
            gen = Generation(sampler, full_prompt, params, TokenFeed(), route)
            body = stream_events(
                request,
                principal,
                req,
                agent,
                full_prompt,
                messages,
                chat,
                gen,
                parse_tools,
                prefix,
                prefix_ids,
                t0,
                response_id,
            )

            async def on_close(_completed: bool) -> None:
                if not gen.settled:
                    abort()

            return WatchedStreamingResponse(body, on_close=on_close, media_type="text/event-stream")

        gen = Generation(sampler, full_prompt, params, None, route)
        work = asyncio.ensure_future(run(request, principal, gen, rollout_failed))
        gone = asyncio.ensure_future(until_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()
            abort()
            return JSONResponse({}, status_code=499)  # nobody is listening
        results = work.result()
        gen.settled = True
        choices, turns = await asyncio.to_thread(
            finish_choices, results, req, parse_tools, prefix, prefix_ids
        )
        await record(
            principal,
            agent,
            req,
            full_prompt,
            choices,
            time.monotonic() - t0,
            messages,
            turns,
            response_id,
        )
        version = max(c.result.policy_version for c in choices)
        build = chat_lib.chat_response if chat else chat_lib.completion_response
        return JSONResponse(
            build(model_name, choices, len(full_prompt), tokenizer, req, version, response_id)
        )

    async def stream_events(
        request,
        principal,
        req,
        agent,
        prompt_ids,
        messages,
        chat,
        gen,
        parse_tools,
        prefix,
        prefix_ids,
        t0,
        cid,
    ):
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"
        version = [sampler.policy_version]

        def chunk(choices, usage=None):
            obj = {
                "id": cid,
                "object": kind,
                "created": created,
                "model": model_name,
                "system_fingerprint": f"policy-{version[0]}",
                "choices": choices,
            }
            if req.include_usage:
                obj["usage"] = usage
            return sse(obj)

        # on_tokens carries no top-logprobs: with top_logprobs > 0 every logprob
        # entry comes with the final result instead of as the tokens arrive.
        incremental_lps = req.logprobs and req.top_logprobs == 0

        offsets = [0] * req.n  # text_offset of the next legacy logprob entry, per choice

        def piece(i, text, part: SampleResult | None, finish=None, extra=None):
            lp = None
            if req.logprobs and part is not None and part.output_ids:
                if chat:
                    lp = chat_lib.chat_logprobs(tokenizer, part, req.top_logprobs)
                else:
                    lp = chat_lib.completion_logprobs(tokenizer, part, req.top_logprobs, offsets[i])
                    offsets[i] += sum(len(t) for t in lp["tokens"])
            if chat:
                delta = dict(extra or {})
                if text:
                    delta["content"] = text
                return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}

        streams = [TextStream(tokenizer, req.stop, parse_tools, prefix) for _ in range(req.n)]
        if chat:
            yield chunk(
                [
                    piece(i, "", None, extra={"role": "assistant", "content": ""})
                    for i in range(req.n)
                ]
            )
        pending = req.n
        while pending:
            items = [await gen.feed.queue.get()]
            while not gen.feed.queue.empty():  # coalesce what is already waiting
                items.append(gen.feed.queue.get_nowait())
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
                    SampleResult(shown, shown_lps, "length", 0)
                    if incremental_lps and shown
                    else None
                )
                if text or part is not None:
                    yield chunk([piece(i, text, part)])
        try:
            results = await run(request, principal, gen, rollout_failed)
            choices, turns = await asyncio.to_thread(
                finish_choices, results, req, parse_tools, prefix, prefix_ids
            )
            gen.settled = True  # done sampling: recorded even if the client leaves now
            await record(
                principal,
                agent,
                req,
                prompt_ids,
                choices,
                time.monotonic() - t0,
                messages,
                turns,
                cid,
            )
        except APIError as e:
            gen.settled = True
            yield sse(e.body())
            return
        except Exception as e:  # noqa: BLE001 - headers are out: report in the stream
            gen.settled = True
            logging.exception("a streamed request failed")
            await rollout_failed(principal, e, counter="server_errors")
            yield sse(APIError(500, "Internal server error", code="internal_error").body())
            return
        version[0] = max(c.result.policy_version for c in choices)
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
                yield chunk([piece(c.index, text, part, extra=extra)])
            yield chunk([piece(c.index, "", None, finish=c.finish_reason)])
        if req.include_usage:
            yield chunk([], chat_lib.usage(len(prompt_ids), [c.result for c in choices]))
        yield "data: [DONE]\n\n"

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        principal = await authenticate(request)
        req = req_lib.parse_chat_request(await read_json(request))
        check_model(req.model)
        agent = agent_label(request, req)
        memory = principal.rollout.memory if principal.rollout else None
        try:
            prompt_ids, _ = await asyncio.to_thread(
                build_prompt_ids, tokenizer, req.messages, req.tools, memory
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as e:
            raise bad_request(
                f"Could not render the chat template: {e}", param="messages"
            ) from None
        return await serve(request, principal, req, agent, prompt_ids, req.messages, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        principal = await authenticate(request)
        req = req_lib.parse_completion_request(await read_json(request))
        check_model(req.model)
        agent = agent_label(request, req)
        if isinstance(req.prompt, str):
            prompt_ids = await asyncio.to_thread(tokenizer.encode, req.prompt)
        else:
            prompt_ids = list(req.prompt)
            bad = [t for t in prompt_ids if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise bad_request(
                    f"'prompt' has token ids outside [0, {tokenizer.vocab_size}): {bad[:5]}",
                    param="prompt",
                )
        if not prompt_ids:
            raise bad_request("'prompt' encodes to no tokens", param="prompt")
        return await serve(request, principal, req, agent, prompt_ids, None, chat=False)
