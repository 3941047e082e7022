"""What one sampling request shares between the plain and the streaming path.

`ServeContext` holds the server-wide pieces (sampler, tokenizer, registry),
`RequestState` one request's parsed fields; `Generation` runs its `n`
samples as tasks. `run_generation`, `finish_choices` and `record` are the
steps both paths take once sampling is under way (see `generation`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from ac2_jax.sampling import (
    ContextLengthError,
    Sampler,
    SamplerError,
    SamplingParams,
    route_key,
    truncate_at_stop,
)
from ac2_jax.serving.core import chat as chat_lib
from ac2_jax.serving.core.errors import APIError, bad_request
from ac2_jax.serving.core.streaming import TokenFeed
from ac2_jax.serving.lifecycle.rollouts import RolloutRegistry
from ac2_jax.text import Tokenizer
from ac2_jax.trace import Completion, routing_length


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass(frozen=True)
class ServeContext:
    """The server-wide pieces the sampling routes use."""

    sampler: Sampler
    tokenizer: Tokenizer
    registry: RolloutRegistry
    model_name: str
    default_max_tokens: int | None


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


@dataclass
class RequestState:
    """One request under way: what was asked and how its samples run."""

    request: Request
    principal: Any
    req: Any
    agent: str
    prompt_ids: list[int]  # the full prompt, forced tool-call prefix included
    messages: list[dict] | None
    chat: bool
    gen: Generation
    parse_tools: bool
    prefix: str
    prefix_ids: list[int]
    t0: float
    response_id: str
    constraint: str | None = None  # the answer's grammar (SamplingParams.constraint)


async def rollout_failed(
    ctx: ServeContext, principal, exc: Exception, counter: str = "sampler_errors"
) -> None:
    """Our fault: counted, and the rollout ends as infra_error (never trained)."""
    rollout = principal.rollout
    if rollout is None:
        return
    ctx.registry.count(rollout, counter)
    if rollout.running:
        with contextlib.suppress(APIError):
            await asyncio.to_thread(
                ctx.registry.finish,
                rollout,
                status="infra_error",
                artifacts={"error": f"{type(exc).__name__}: {exc}"},
            )


async def run_generation(ctx: ServeContext, principal, gen: Generation):
    """The samples, with errors mapped; a SamplerError ends the rollout (503)."""
    try:
        return await gen.results()
    except ContextLengthError as e:
        raise bad_request(str(e), param="messages", code="context_length_exceeded") from None
    except SamplerError as e:
        logging.warning("sampler failed a request: %s", e)
        await rollout_failed(ctx, principal, e)
        raise APIError(
            503,
            "The sampler failed this request; the rollout ends as "
            "infra_error. Retrying in a new rollout may succeed",
            code="sampler_error",
        ) from None
    except ValueError as e:
        raise bad_request(f"The sampler rejected the request: {e}") from None


def routing_of(result, prompt_len: int) -> str | None:
    """The result's recorded expert routing (MoE samplers: prompt + output tokens) when it
    covers exactly the completion's tokens, else None (the caller counts it)."""
    routed = result.routed_experts
    if routed is None or routing_length(routed) != prompt_len + len(result.output_ids):
        return None
    return routed


def finish_choices(ctx: ServeContext, results, st: RequestState):
    """The choices the samples make (stops cut, tool calls parsed), and their turns."""
    tokenizer = ctx.tokenizer
    cut = [truncate_at_stop(r, st.req.stop, tokenizer.decode) for r in results]
    choices = [
        chat_lib.choice_from_result(i, r, m, tokenizer, st.parse_tools, prefix=st.prefix)
        for i, (r, m) in enumerate(cut)
    ]
    turns = [(c.content, c.tool_calls, st.prefix_ids + list(c.result.output_ids)) for c in choices]
    return choices, turns


async def record(ctx: ServeContext, st: RequestState, choices, elapsed: float, turns) -> None:
    """Records the request's n choices, each with the response id the client sees
    and its choice index (how RL knows which response a harness continued)."""
    principal, req = st.principal, st.req
    if principal.rollout is None:
        return
    comps = [
        Completion(
            prompt_ids=list(st.prompt_ids),
            output_ids=list(c.result.output_ids),
            output_logprobs=[float(x) for x in c.result.output_logprobs],
            policy_version=int(c.result.policy_version),
            finish_reason=c.finish_reason,
            timings={"sample_s": elapsed},
            cached_tokens=int(c.result.cached_tokens),
            messages=st.messages,
            temperature=float(req.temperature),
            top_k=int(req.top_k),
            top_p=float(req.top_p),
            request_id=st.response_id,
            choice_index=int(c.index),
            constraint=st.constraint,
            adapter=req.model.partition("@")[2] or None,  # checked: generation.model_adapter
            routed_experts=routing_of(c.result, len(st.prompt_ids)),
            output_versions=(
                None
                if c.result.output_versions is None
                else [int(v) for v in c.result.output_versions]
            ),
        )
        for c in choices
    ]
    unmatched = sum(1 for c in choices if c.result.routed_experts is not None) - sum(
        1 for comp in comps if comp.routed_experts is not None
    )
    if unmatched:  # the learner routes those tokens itself: counted, never silent
        ctx.registry.count(principal.rollout, "routing_not_recorded", unmatched)
    await asyncio.to_thread(ctx.registry.record, principal.rollout, st.agent, comps, list(turns))
    malformed = sum(c.malformed_tool_calls for c in choices)
    if malformed:
        ctx.registry.count(principal.rollout, "malformed_tool_calls", malformed)
