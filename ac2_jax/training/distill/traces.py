"""(a) Offline self-distillation data: stored traces + their hints -> DistillExamples.

`examples_from_traces` teaches every completion of every selected episode
(main, compactor, subagents) with the trace's hints inserted into the
request the endpoint recorded (`insert_hint`). A hinted trace that cannot be
taught is skipped whole and counted by reason; the others go on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np

from ac2_jax.trace.agents import SUBAGENT_WILDCARD, agent_matches, check_agent_pattern, is_subagent
from ac2_jax.trace.types import Trace
from ac2_jax.training.distill.data import DistillExample, HintConfig, insert_hint

_DEFAULT_HINT = HintConfig()


def hint_config_for(config: HintConfig | Mapping[str, HintConfig], agent: str) -> HintConfig:
    """One HintConfig for all agents, or the most specific key of a mapping: the
    exact label, then "subagent:*" (every subagent), then "*" (every agent)."""
    if isinstance(config, HintConfig):
        return config
    for key in (agent, SUBAGENT_WILDCARD if is_subagent(agent) else None, "*"):
        if key is not None and key in config:
            return config[key]
    raise ValueError(
        f"examples_from_traces: no HintConfig for agent {agent!r} (keys "
        f"{sorted(config)}); add it, '{SUBAGENT_WILDCARD}' or '*'"
    )


def _sampling(c) -> tuple:
    return (getattr(c, "temperature", None), getattr(c, "top_k", 0), getattr(c, "top_p", 1.0))


def _constraint(c) -> str | None:
    return getattr(c, "constraint", None)


def _mergeable(run: list, item: tuple) -> bool:
    """`item` continues the run's example: its prompt extends the previous prompt +
    output, and the hint enters at the same place with the same ids. A completion
    sampled under a grammar is never merged (its example carries the grammar)."""
    (first, teacher0, (a, b)), (prev, _, _), (c, teacher, span) = run[0], run[-1], item
    done = list(prev.prompt_ids) + list(prev.output_ids)
    return (
        _constraint(c) is None
        and _constraint(first) is None
        and list(c.prompt_ids[: len(done)]) == done
        and span == (a, b)
        and teacher[a:b] == teacher0[a:b]
        and _sampling(c) == _sampling(first)
    )


def _run_example(run: list, hint: str, task: str, agent: str) -> DistillExample:
    first, teacher, span = run[0]
    last = run[-1][0]
    p0 = len(first.prompt_ids)
    response = list(last.prompt_ids[p0:]) + list(last.output_ids)
    mask, lps = np.zeros(len(response)), np.zeros(len(response))
    spans = []
    for c, _, _ in run:
        lo = len(c.prompt_ids) - p0
        mask[lo : lo + len(c.output_ids)] = 1.0
        lps[lo : lo + len(c.output_ids)] = c.output_logprobs
        spans.append((lo, lo + len(c.output_ids)))
    temperature, top_k, top_p = _sampling(first)
    return DistillExample(
        list(first.prompt_ids),
        teacher,
        response,
        hint,
        task,
        hint_span=span if hint else None,
        response_logprobs=lps.tolist(),
        messages=None if first.messages is None else list(first.messages),
        response_mask=None if len(run) == 1 else mask.tolist(),
        response_spans=None if len(run) == 1 else spans,
        agent=agent,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        constraint=_constraint(first),
    )


COUNTS = (
    "traces",
    "traces_without_hints",
    "completions",
    "empty_outputs",
    "examples",
    "skipped_traces",
)
# Why a hinted trace gives no example at all (counted as "skipped/<reason>").
SKIP_REASONS = {
    "no_messages": "a completion has no recorded messages (needed to place the hint)",
    "messages_unreadable": "a completion's messages cannot be rebuilt from the stored deltas",
    "hint_not_insertable": "insert_hint cannot place the hint in a completion's prompt",
}


class _SkipTrace(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def _trace_examples(
    tr: Trace, tokenizer, config, agents, hint: str, merge: bool, counts: dict
) -> list[DistillExample]:
    """The examples of one hinted trace; `_SkipTrace` when one cannot be made."""
    out = []
    for ep in tr.episodes:
        if not agent_matches(ep.agent, agents):
            continue
        cfg = hint_config_for(config, ep.agent)
        try:
            completions = ep.with_messages()
        except ValueError as e:
            raise _SkipTrace("messages_unreadable", str(e)) from None
        run: list = []
        for c in completions:
            counts["completions"] += 1
            if not c.output_ids:
                counts["empty_outputs"] += 1
                continue
            if not hint:  # a teacher model without a hint: it reads the student's prompt
                teacher, span = list(c.prompt_ids), (0, 0)
            elif c.messages is None:
                raise _SkipTrace("no_messages", f"agent {ep.agent!r}")
            else:
                try:
                    _, teacher, span = insert_hint(tokenizer, c.messages, hint, cfg, c.prompt_ids)
                except ValueError as e:
                    raise _SkipTrace("hint_not_insertable", str(e)) from None
            item = (c, teacher, span)
            if run and merge and _mergeable(run, item):
                run.append(item)
                continue
            if run:
                out.append(_run_example(run, hint, tr.key, ep.agent))
            run = [item]
        if run:
            out.append(_run_example(run, hint, tr.key, ep.agent))
    return out


def examples_from_traces(
    traces: Sequence[Trace],
    tokenizer,
    config: HintConfig | Mapping[str, HintConfig] = _DEFAULT_HINT,
    agents: str | Sequence[str] | None = None,
    hint_join: str = "\n",
    merge: bool = True,
    counts: dict | None = None,
    unhinted: bool = False,
) -> list[DistillExample]:
    """(a) Offline: every completion of every selected episode of each hinted trace.

    agents: None (main, compactor, subagents: every episode) or agent labels
    and "subagent:*" (every "subagent:<name>"; `trace.agent_matches`). config:
    one HintConfig, or one per agent label / "subagent:*" / "*" (see
    `hint_config_for`).
    For each completion the student prompt is its prompt_ids, the response
    its output_ids, and the teacher prompt its own request (`messages`,
    recorded by the endpoint) with the trace's hints (joined) inserted. All
    examples of a trace share its key as task (one group in task_mean).

    merge: consecutive completions of an append-only episode whose hint
    enters at the same token position with the same ids (e.g. placement
    "system", or "after_user" with one user message) become one example with
    response_mask 1 on each output span and `response_spans` marking each
    request's output, equal to the per-request examples (causal attention) in
    one forward pass, and RMSD's top-T budget stays per request. Otherwise ("before_turn" moves
    with each request) each completion is its own example. Either way every
    output token is trained exactly once.

    unhinted: also teach the traces without hints, the teacher reading the
    student's own prompt (on-policy distillation from a teacher model: the
    self-teacher would be the student itself); they are counted as
    "traces_without_hints" either way. Completions with no output give no
    example. Without `unhinted`, traces without hints give none either. A
    hinted trace that cannot be taught (one of `SKIP_REASONS`, e.g. its hint
    cannot be inserted) gives none at all: it is skipped whole, counted as
    "skipped_traces" and "skipped/<reason>", and each reason is logged once per
    call; the others go on. `counts` (a dict, if given) adds up the skips and
    the examples made.
    """
    for pattern in (agents,) if isinstance(agents, str) else agents or ():
        check_agent_pattern(pattern, "examples_from_traces: agents")
    if not isinstance(config, HintConfig):
        for key in config:
            if key != "*":
                check_agent_pattern(key, "examples_from_traces: config")
    counts = {} if counts is None else counts
    for k in COUNTS:
        counts.setdefault(k, 0)
    out, logged = [], set()
    for tr in traces:
        counts["traces"] += 1
        if not tr.hints:
            counts["traces_without_hints"] += 1
            if not unhinted:
                continue
        try:
            out.extend(
                _trace_examples(
                    tr, tokenizer, config, agents, hint_join.join(tr.hints), merge, counts
                )
            )
        except _SkipTrace as e:
            counts["skipped_traces"] += 1
            key = f"skipped/{e.reason}"
            counts[key] = counts.get(key, 0) + 1
            if e.reason not in logged:
                logged.add(e.reason)
                logging.warning(
                    "examples_from_traces: skipping trace %r (%s: %s: %s); later "
                    "traces skipped for this reason are only counted (counts[%r])",
                    tr.key,
                    e.reason,
                    SKIP_REASONS[e.reason],
                    e,
                    key,
                )
    counts["examples"] += len(out)
    return out
