"""Multi-response branches: which of a request's n responses the attempt continued.

A multi-response request asks for n responses to one prompt and the harness
continues one of them. The endpoint records each response as a completion
carrying the request's response id (`Completion.request_id`, the id the
client saw) and its `choice_index`; the harness says which one it continued
in its metrics, `branch_choices`: one {"request_id", "index"} per
multi-response request (MultiResponseOrchestrator writes them; run_rollout
stores them in the rollout's artifacts whatever the attempt's status).

The rule (docs/design.md "Signal rules"): every token the continued path
sampled trains exactly once; the responses that were not continued train
nothing. The recorder puts response 0 in the episode its prompt extends and
each other response in a new episode whose earlier turns are context (mask
0); the continuation goes to the chosen response's episode. So when the
chosen response is not 0, the episode that holds the earlier, continued
turns ends in an unchosen response: dropping episodes would drop those turns.
The rule is therefore applied per completion: an unchosen response's output
gets loss mask 0 in its episode and every other token keeps its mask.

A branch group whose choice the trace does not record (a harness that
records none, an attempt that failed before it chose, an older store whose
choices carry no request id) trains none of its responses: never a guess.
Both kinds of left-out tokens are counted (`BranchCounts`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ac2_jax.trace.types import Episode, Trace

Slot = tuple[int, int]  # (episode index, completion index) of a trace's completion


@dataclasses.dataclass
class BranchCounts:
    """What `continued_path` left out of one trace (or, summed, of a batch)."""

    unchosen_responses: int = 0  # responses of known groups that were not continued
    unchosen_tokens: int = 0  # their sampled tokens
    unknown_groups: int = 0  # multi-response requests with no recorded choice
    unknown_tokens: int = 0  # the sampled tokens of all their responses

    def add(self, other: BranchCounts) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def branch_groups(trace: Trace) -> list[list[Slot]]:
    """The completions of each multi-response request (n > 1), members in choice order.

    Members share the agent and `request_id`; completions without a request id
    (older stores, traces built by hand) are grouped by agent and prompt ids,
    in recording order. Groups come in order of their first member.
    """
    groups: dict[tuple, list[tuple[int, Slot]]] = {}
    for i, ep in enumerate(trace.episodes):
        for j, c in enumerate(ep.completions):
            key = (
                (ep.agent, "id", c.request_id)
                if c.request_id is not None
                else (ep.agent, "prompt", tuple(c.prompt_ids))
            )
            order = c.choice_index if c.request_id is not None else len(groups.get(key, ()))
            groups.setdefault(key, []).append((order, (i, j)))
    return [
        [slot for _, slot in sorted(members)] for members in groups.values() if len(members) > 1
    ]


def recorded_choices(trace: Trace) -> dict[str, int]:
    """request_id -> the index the harness continued, from the trace's recorded
    `branch_choices` (the rollout's artifacts, else the trace's own metrics).
    Entries without a request id (older stores wrote bare indices) say nothing."""
    artifacts = (trace.metadata or {}).get("artifacts") or {}
    metrics: dict[str, Any] = artifacts.get("metrics") or {}
    entries = metrics.get("branch_choices")
    if entries is None:
        entries = (trace.metrics or {}).get("branch_choices") or []
    out = {}
    for e in entries:
        if isinstance(e, dict) and e.get("request_id") is not None:
            out[str(e["request_id"])] = int(e["index"])
    return out


def left_out_responses(trace: Trace) -> tuple[set[Slot], set[Slot]]:
    """(unchosen, unknown): completions whose outputs do not train. `unchosen`: the
    members of recorded groups other than the continued one; `unknown`: every
    member of a group whose choice is not recorded (or names no member)."""
    choices = recorded_choices(trace)
    unchosen: set[Slot] = set()
    unknown: set[Slot] = set()
    for members in branch_groups(trace):
        i, j = members[0]
        rid = trace.episodes[i].completions[j].request_id
        chosen = None
        if rid is not None and rid in choices:
            chosen = next(
                (
                    s
                    for s in members
                    if trace.episodes[s[0]].completions[s[1]].choice_index == choices[rid]
                ),
                None,
            )
        if chosen is None:
            unknown.update(members)
        else:
            unchosen.update(s for s in members if s != chosen)
    return unchosen, unknown


def _output_span(c) -> tuple[int, int]:
    """Where completion `c`'s output sits in its append-only episode."""
    return len(c.prompt_ids), len(c.prompt_ids) + len(c.output_ids)


def _masked_episode(ep: Episode, slots: list[int]) -> tuple[Episode, int]:
    """A copy of `ep` with loss mask 0 on the outputs of its completions `slots`;
    returns it and how many trained tokens that took out."""
    mask = list(ep.loss_mask)
    removed = 0
    for j in slots:
        lo, hi = _output_span(ep.completions[j])
        removed += sum(1 for m in mask[lo:hi] if m)
        mask[lo:hi] = [0] * (hi - lo)
    return dataclasses.replace(ep, loss_mask=mask), removed


def continued_path(trace: Trace) -> tuple[Trace, BranchCounts]:
    """`trace` with only its continued path trained (see the module docstring):
    a copy whose episodes have loss mask 0 on every response that was not
    continued or whose choice is unknown, and what that left out. The input is
    not changed; a trace without multi-response requests comes back as is."""
    unchosen, unknown = left_out_responses(trace)
    counts = BranchCounts()
    if not unchosen and not unknown:
        return trace, counts
    counts.unchosen_responses = len(unchosen)
    counts.unknown_groups = sum(1 for g in branch_groups(trace) if set(g) <= unknown)
    episodes = []
    for i, ep in enumerate(trace.episodes):
        gone = [j for j in range(len(ep.completions)) if (i, j) in unchosen]
        lost = [j for j in range(len(ep.completions)) if (i, j) in unknown]
        ep, n_gone = _masked_episode(ep, gone)
        ep, n_lost = _masked_episode(ep, lost)
        counts.unchosen_tokens += n_gone
        counts.unknown_tokens += n_lost
        episodes.append(ep)
    return dataclasses.replace(trace, episodes=episodes), counts


def unchosen_branch_episodes(trace: Trace) -> set[int]:
    """Indices of `trace.episodes` that keep no trained token on the continued path
    (`continued_path`): episodes that leave the batch whole. An episode that
    also holds continued turns stays, with its left-out responses masked."""
    kept, _ = continued_path(trace)
    return {
        i
        for i, (old, new) in enumerate(zip(trace.episodes, kept.episodes, strict=True))
        if old.num_agent_tokens and not new.num_agent_tokens
    }
