"""Multi-response branches (`training/rl/branches.py`): only the continued path trains.

A property test over random multi-response attempts: a small simulated harness
makes requests for several agents (n random, branch groups at random depths,
restarts that start new episodes, some choices never recorded), feeds the
endpoint's recorder exactly as the endpoint does, and keeps its own record of
what it continued. The tokens that train (in `continued_path` and in a built
batch, both segment views) must be exactly the continued path's, each once,
and every token left out must be counted.
"""

import collections
import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ac2_jax.trace import Completion, Trace, TraceRecorder
from ac2_jax.training.rl import (
    BatchConfig,
    branch_groups,
    build_batch,
    continued_path,
    recorded_choices,
)

AGENTS = ("main", "compactor", "subagent:helper")


def _simulate(data):
    """(trace, reference): a random attempt, and what its harness knows it continued:
    the multiset of output tokens of continued responses (n = 1 ones included; none of
    a group whose choice went unrecorded), and the counts of what was left out."""
    fresh = itertools.count(1)
    trace = Trace(task_id="t", attempt_id="0", group_id="g", reward=1.0, status="finished")
    rec = TraceRecorder(trace)
    history: dict[str, list[int] | None] = {a: None for a in AGENTS}
    choices, trained = [], []
    ref = collections.Counter()
    for k in range(data.draw(st.integers(1, 8), label="requests")):
        agent = data.draw(st.sampled_from(AGENTS), label="agent")
        if history[agent] is None or data.draw(st.booleans(), label="restart"):
            history[agent] = [next(fresh) for _ in range(data.draw(st.integers(1, 3)))]
        prompt = history[agent] + [next(fresh) for _ in range(data.draw(st.integers(0, 2)))]
        n = data.draw(st.integers(1, 3), label="n")
        outs = [[next(fresh) for _ in range(data.draw(st.integers(0, 3)))] for _ in range(n)]
        rid = f"chatcmpl-{k}"
        for i, out in enumerate(outs):
            rec.record(agent, Completion(list(prompt), out, [-0.5] * len(out),
                                         request_id=rid, choice_index=i))
        chosen = data.draw(st.integers(0, n - 1), label="chosen")
        if n == 1:
            trained += outs[0]
        elif data.draw(st.integers(0, 4), label="recorded") > 0:  # 1 in 5: never recorded
            choices.append({"request_id": rid, "index": chosen})
            trained += outs[chosen]
            ref["unchosen_responses"] += n - 1
            ref["unchosen_tokens"] += sum(len(o) for i, o in enumerate(outs) if i != chosen)
        else:
            ref["unknown_groups"] += 1
            ref["unknown_tokens"] += sum(len(o) for o in outs)
        history[agent] = prompt + outs[chosen]  # the harness continues the chosen response
    trace.metadata = {"artifacts": {"metrics": {"branch_choices": choices}}}
    return trace, collections.Counter(trained), ref


def _trained(trace) -> collections.Counter:
    return collections.Counter(t for e in trace.episodes
                               for t, m in zip(e.token_ids, e.loss_mask) if m)


@settings(max_examples=250, deadline=None, database=None)
@given(st.data())
def test_the_trained_tokens_are_the_continued_path_each_once(data):
    trace, want, ref = _simulate(data)
    masks = [list(e.loss_mask) for e in trace.episodes]
    kept, counts = continued_path(trace)
    assert [list(e.loss_mask) for e in trace.episodes] == masks  # the input is not changed
    assert _trained(kept) == want
    assert (counts.unchosen_responses, counts.unchosen_tokens, counts.unknown_groups,
            counts.unknown_tokens) == (ref["unchosen_responses"], ref["unchosen_tokens"],
                                       ref["unknown_groups"], ref["unknown_tokens"])
    assert sum(e.num_agent_tokens for e in trace.episodes) == sum(
        len(c.output_ids) for e in trace.episodes for c in e.completions)
    other = Trace(task_id="t", attempt_id="1", group_id="g", reward=0.0, status="finished")
    TraceRecorder(other).record("main", Completion([1], [0], [-0.5]))
    for mode in ("episode", "request"):
        batch, stats, _ = build_batch([trace, other], 0,
                                      BatchConfig(seq_len=64, segment_mode=mode))
        got = collections.Counter(np.asarray(batch.targets)[
            (np.asarray(batch.loss_mask) > 0) & (np.asarray(batch.features["advantages"]) > 0)].tolist())
        assert got == want, mode
        assert (stats.unchosen_responses, stats.unchosen_tokens, stats.unknown_branch_groups,
                stats.unknown_branch_tokens) == (counts.unchosen_responses,
                                                 counts.unchosen_tokens, counts.unknown_groups,
                                                 counts.unknown_tokens)


def test_groups_are_found_by_request_id_whatever_the_prompt():
    """Two requests with one prompt are two groups; one request's n responses are one."""
    t = Trace(task_id="t", attempt_id="0")
    rec = TraceRecorder(t)
    for rid in ("a", "b"):
        for i in range(2):
            rec.record("main", Completion([1, 2], [10 + i], [-0.5], request_id=rid,
                                          choice_index=i))
    assert [len(g) for g in branch_groups(t)] == [2, 2]
    t.metadata = {"artifacts": {"metrics": {"branch_choices": [
        {"request_id": "a", "index": 1}, 3, {"request_id": None, "index": 0}]}}}
    assert recorded_choices(t) == {"a": 1}  # bare indices and id-less entries say nothing
    t.metadata = {}
    t.metrics = {"branch_choices": [{"request_id": "b", "index": 0}]}  # the trace's own metrics
    assert recorded_choices(t) == {"b": 0}
