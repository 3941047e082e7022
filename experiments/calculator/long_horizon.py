"""The long-horizon main job's own parts (issue 18): the compacting harness, its
demonstrations and its per-agent figures. `calculator_agent` picks them when
the config's `harness.kind` is "compaction".

Demonstrations are recorded, not written by hand: the real
CompactionOrchestrator runs each task against `PolicyClient`, an
OpenAI-compatible client whose replies come from the env's scripted policy
(`chain_policy`) and whose usage counts come from the real tokenizer and chat
template. Every request it sees (main or compactor, with that agent's own
prompt and the transcript exactly as the orchestrator builds it) becomes one
SFT segment, so the warm start is the shape of what RL sends later.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import openai

from ac2_jax.envs import ChainCalculatorEnv, chain_policy
from ac2_jax.evals.stats import Estimate, clustered_interval, paired_difference
from ac2_jax.orchestration import CompactionOrchestrator
from ac2_jax.orchestration.base import AGENT_HEADER, SingleTaskUser, run_task
from ac2_jax.training.rl.metrics import trace_agent_metrics
from ac2_jax.training.sft.demos import demo_segment


def build_chain_env(cfg) -> ChainCalculatorEnv:
    e = cfg.env
    return ChainCalculatorEnv(ops_range=tuple(e.ops_range), value_range=tuple(e.value_range),
                              operand_range=tuple(e.operand_range), signs=e.get("signs", "+-"))


def compaction_factory(cfg, sampling: dict, max_steps: int):
    """Orchestrator factory of the long variant: CompactionOrchestrator that restarts
    the main agent from system prompt + task + memo only (keep_exchange=False)."""
    h = cfg.harness

    def make(env, task, client, model_name):
        return CompactionOrchestrator(env, task, client, model_name, max_steps=max_steps,
                                      sampling=dict(sampling), context_budget=h.context_budget,
                                      keep_exchange=h.keep_exchange,
                                      message_overhead_tokens=h.get("message_overhead_tokens",
                                                                    0),
                                      max_consecutive_compactions=h.max_consecutive_compactions,
                                      compactor_sampling=h.get("compactor_sampling"),
                                      **({"memo_prefix": h.memo_prefix} if "memo_prefix" in h
                                         else {}))
    return make


class PolicyClient:
    """An OpenAI-compatible client (`client.chat.completions.create`) answering with
    `policy(agent, messages, tools) -> assistant message dict`; usage is counted
    with `tokenizer`'s chat template as the endpoint counts it. `requests` keeps
    (agent, messages, tools, reply) of every request, in order."""

    def __init__(self, policy: Callable[[str, list, list | None], dict], tokenizer):
        self.policy, self.tokenizer = policy, tokenizer
        self.requests: list[tuple[str, list[dict], list | None, dict]] = []
        self.chat = self.completions = self

    async def create(self, *, model, messages, extra_headers=None, tools=None, **kw):
        agent = (extra_headers or {}).get(AGENT_HEADER, "main")
        messages = [dict(m) for m in messages]
        reply = self.policy(agent, messages, tools)
        self.requests.append((agent, messages, tools, reply))
        tok = self.tokenizer
        prompt = len(tok.encode(tok.apply_chat_template(messages, tools=tools,
                                                        add_generation_prompt=True)))
        full = len(tok.encode(tok.apply_chat_template(messages + [reply], tools=tools,
                                                      add_generation_prompt=False)))
        calls = reply.get("tool_calls") or None
        return openai.types.chat.ChatCompletion.model_validate({
            "id": "demo", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "logprobs": None,
                         "finish_reason": "tool_calls" if calls else "stop",
                         "message": {"role": "assistant", "content": reply.get("content") or None,
                                     "tool_calls": calls}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": full - prompt,
                      "total_tokens": full}})


def compaction_policy(cfg, rng: random.Random):
    """policy(agent, messages, tools) of the compacting variant's demonstrations."""
    d = cfg.demos
    return lambda agent, messages, tools: chain_policy(
        agent, messages, rng, memo_error_prob=d.memo_error_prob,
        main_slip_prob=d.main_slip_prob, memo_error=d.get("memo_error", "garble"))


def record_demos(env, tasks, tokenizer, make_orchestrator, policy):
    """Runs the real orchestrator on each task, one after the other, with the
    scripted `policy(agent, messages, tools) -> reply`. Returns
    [(ConversationTrace, [(agent, messages, tools, reply), ...]) per task].
    Callable from inside an event loop (the pipeline's): the demos then run on
    their own loop in a worker thread."""

    async def all_demos():
        out = []
        for task in tasks:
            client = PolicyClient(policy, tokenizer)
            conv = await run_task(make_orchestrator(env, task, client, "demo"), SingleTaskUser())
            out.append((conv, client.requests))
        return out

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(all_demos())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, all_demos()).result()


def episode_requests(requests: list) -> list:
    """The requests that end an episode: a request whose messages the same agent's
    next request extends (the tool loop within one main episode) is part of that
    one, so each episode is one SFT segment, as the endpoint records it."""
    out = []
    for i, (agent, messages, tools, reply) in enumerate(requests):
        nxt = next((r for r in requests[i + 1:] if r[0] == agent), None)
        # Extends it with this reply (the tool loop): not a restart that keeps the
        # same system prompt and task and adds a memo (keep_exchange=False).
        if (nxt is not None and len(nxt[1]) > len(messages)
                and nxt[1][:len(messages)] == messages
                and nxt[1][len(messages)].get("role") == "assistant"):
            continue
        out.append((agent, messages, tools, reply))
    return out


def long_demo_segments(env, tasks, tokenizer, make_orchestrator, policy, log=print,
                       judged: str = "memo_ok"):
    """SFT segments of recorded demos: one per episode (main, compactor, subagent),
    every reply of the episode trained; one SFT task per demo (whole demos per batch).
    `judged`: the harness event key counted in the log (memos or helper answers)."""
    segments, stats = [], {"demos": 0, "passed": 0, "judged": 0, "judged_ok": 0, "segments": {}}
    demos = record_demos(env, tasks, tokenizer, make_orchestrator, policy)
    for t, (conv, requests) in zip(tasks, demos):
        stats["demos"] += 1
        stats["passed"] += int(env.verify(t, conv.answer) >= 1.0)
        verdicts = [e[judged] for e in conv.events if e.get(judged) is not None]
        stats["judged"] += len(verdicts)
        stats["judged_ok"] += sum(verdicts)
        for agent, messages, tools, reply in episode_requests(requests):
            segments.append(demo_segment(tokenizer, messages + [reply], tools, task=t.task_id,
                                         agent=agent))
            stats["segments"][agent] = stats["segments"].get(agent, 0) + 1
    log(f"demos: {stats['demos']} attempts, {stats['passed']} pass; {judged} "
        f"{stats['judged_ok']}/{stats['judged']}; segments per agent {stats['segments']}")
    return segments, stats


def corpus_conversations(env, tasks, make_orchestrator, policy) -> list[tuple[list, list | None]]:
    """Message lists of demo requests for the tokenizer's training corpus (the
    usage counts do not matter here, so a character-count tokenizer stands in)."""
    out = []

    class _Chars:
        def apply_chat_template(self, messages, tools=None, add_generation_prompt=False):
            return "".join(str(m.get("content") or "") + str(m.get("tool_calls") or "")
                           for m in messages) + (str(tools) if tools else "")

        def encode(self, text):
            return list(range(len(text) // 4))

    for _, requests in record_demos(env, tasks, _Chars(), make_orchestrator, policy):
        out += [(messages + [reply], tools) for _, messages, tools, reply in requests]
    return out


# Harness events that judge a link of the attempt, and the figure each one gives.
FIDELITIES = {"memo_ok": "memo_fidelity", "helper_ok": "helper_fidelity"}


def agent_figures(result, level: float = 0.95) -> dict[str, Any]:
    """Per-agent figures of an eval run (an EvalResult with its traces): memo
    fidelity (share of judged memos that carry the value the next step needs;
    clustered-t interval over tasks) and helper fidelity (share of judged subagent
    answers that are right; None where nothing was judged), compactions per attempt,
    episodes per trace, and episodes per agent label per trace."""
    per_task: dict[str, dict[str, list[float]]] = {k: {} for k in FIDELITIES}
    compactions, episodes, by_agent = [], [], {}
    for rec, tr in zip(result.attempts, result.traces):
        if not rec.scored:
            continue
        events = tr.events
        compactions.append(sum(e.get("kind") == "compaction" for e in events))
        episodes.append(len(tr.episodes))
        for ep in tr.episodes:
            by_agent[ep.agent] = by_agent.get(ep.agent, 0) + 1
        for key, by_task in per_task.items():
            by_task.setdefault(rec.task_id, []).extend(
                float(e[key]) for e in events if e.get(key) is not None)
    figures: dict[str, Any] = {}
    for key, name in FIDELITIES.items():
        judged = [v for v in per_task[key].values() if v]
        est = clustered_interval(judged, level, bounds=(0.0, 1.0)) if len(judged) > 1 else None
        figures[name] = est.to_dict() if est else None
        figures[f"{key}_judged"] = int(sum(len(v) for v in judged))
    n = max(len(episodes), 1)
    scored = [tr for rec, tr in zip(result.attempts, result.traces) if rec.scored]
    return {**figures,
            # The RL step log's figures (agent tokens per agent, ...) on the eval's traces.
            "trace_metrics": trace_agent_metrics(scored),
            "memos_judged": figures["memo_ok_judged"],
            "compactions_per_attempt": float(np.mean(compactions)) if compactions else 0.0,
            "episodes_per_trace": float(np.mean(episodes)) if episodes else 0.0,
            "episodes_per_trace_by_agent": {a: c / n for a, c in sorted(by_agent.items())}}


_STATE_RE = re.compile(r"Start at (\d+)\. Apply ([+-]\d+), (\d+) times\.")


def count_main_requests(traces, tokenizer, judge) -> dict[str, dict[str, float]]:
    """Every request of the main agent, in order per trace, judged by `judge(prompt,
    output, first) -> (kind, ok)` on the decoded texts (`first`: the attempt's first
    main request). Returns {kind: {"n", "correct", "rate"}}."""
    counts: dict[str, list[int]] = {}
    for tr in traces:
        first = True
        for ep in tr.episodes:
            if ep.agent != "main":
                continue
            for c in ep.completions:
                kind, ok = judge(tokenizer.decode(list(c.prompt_ids)),
                                 tokenizer.decode(list(c.output_ids)), first)
                first = False
                n_ok = counts.setdefault(kind, [0, 0])
                n_ok[0] += 1
                n_ok[1] += int(ok)
    return {k: {"n": n, "correct": ok, "rate": ok / n} for k, (n, ok) in sorted(counts.items())}


def main_request_accuracy(traces, tokenizer) -> dict[str, dict[str, float]]:
    """Where the main agent slips: each main request judged against the state it
    was shown (the last "Start at V. Apply OP, N times." of its prompt: the task,
    or the memo after a compaction), so a slip is counted where it happens, not
    where it surfaces. Kinds: "first_call" (the attempt's first request: a call
    on "V OP"), "later_call" (a call after a restart), "answer" (N = 0: "The
    answer is V."). Returns {kind: {"n", "correct", "rate"}}; a request whose
    prompt shows no state counts under "no_state"."""
    def judge(prompt, out, first):
        states = _STATE_RE.findall(prompt)
        if not states:
            return "no_state", False
        value, op, left = states[-1]
        if int(left) == 0:
            return "answer", f"The answer is {int(value)}." in out
        return ("first_call" if first else "later_call",
                f'"expression": "{int(value)}{op}"' in out)
    return count_main_requests(traces, tokenizer, judge)


def memo_fidelity_difference(after, before, key: str = "memo_ok",
                             level: float = 0.95) -> Estimate | None:
    """Paired after - before memo fidelity (or the fidelity of the link judged by the
    events' `key`, e.g. "helper_ok") over tasks judged in both runs (paired t)."""
    def per_task(result):
        out: dict[str, list[float]] = {}
        for rec, tr in zip(result.attempts, result.traces):
            if rec.scored:
                out.setdefault(rec.task_id, []).extend(
                    float(e[key]) for e in tr.events if e.get(key) is not None)
        return {t: float(np.mean(v)) for t, v in out.items() if v}
    a, b = per_task(after), per_task(before)
    both = [t for t in after.task_ids if t in a and t in b]
    if len(both) < 2:
        return None
    return paired_difference([a[t] for t in both], [b[t] for t in both], level)
