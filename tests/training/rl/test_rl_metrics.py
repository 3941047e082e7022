"""rl/metrics: per-agent figures over traces (generated tokens, episodes, compactions, memo
fidelity), staleness histogram, and the batch's trained tokens per agent group; the
keys go through MetricsLogger as train/name/<sub>."""

import json

import numpy as np
import pytest

from ac2_jax.trace import Completion, Trace, TraceRecorder, agent_group
from ac2_jax.training.core.metrics_log import MetricsLogger, read_metrics
from ac2_jax.training.rl import BatchConfig, build_batch
from ac2_jax.training.rl.metrics import (
    batch_metrics,
    compaction_events,
    memo_results,
    staleness_histogram,
    trace_agent_metrics,
)


def _trace(attempt, reward, agents, events=(), version=0, group="g"):
    """One attempt, each agent's request a new episode of 2 + k agent tokens (k: its place)."""
    t = Trace(task_id="t", attempt_id=str(attempt), group_id=group, reward=reward,
              status="finished",
              metadata={"artifacts": {"answer": "x", "events": [dict(e) for e in events]}})
    rec = TraceRecorder(t)
    for k, agent in enumerate(agents):
        out = [100 * (attempt + 1) + 10 * k + i for i in range(2 + k)]
        rec.record(agent, Completion([k + 1, 2, 3], out, [-0.5] * len(out),
                                     policy_version=version))
    return t


COMPACTION = {"agent": "compactor", "kind": "compaction", "memo": "at 17"}
EVENTS = [dict(COMPACTION, memo_ok=True), {"agent": "compactor", "kind": "compaction_error",
                                           "reason": "did not shrink"},
          dict(COMPACTION, memo_ok=False), COMPACTION]  # the last one not judged


def test_agent_groups_and_compaction_events():
    assert [agent_group(a) for a in ("main", "compactor", "subagent:helper", "subagent")] == [
        "main", "compactor", "subagent", "subagent"]
    t = _trace(0, 1.0, ["main"], EVENTS)
    assert [e.get("memo_ok") for e in compaction_events(t)] == [True, False, None]
    assert t.events == EVENTS and Trace.from_dict(t.to_dict()).events == EVENTS
    assert Trace(task_id="x").events == [] and memo_results([t, Trace(task_id="x")]) == [
        [True, False], []]


def test_trace_agent_metrics_counts_each_agent_group():
    a = _trace(0, 1.0, ["main", "compactor", "main", "subagent:helper", "subagent:calc"], EVENTS)
    b = _trace(1, 0.0, ["main", "compactor", "main"], [dict(COMPACTION, memo_ok=True)])
    c = _trace(2, 0.0, ["main"])
    m = trace_agent_metrics([a, b, c])
    # a: main 2 + 4, compactor 3, subagents 5 + 6; b: main 2 + 4, compactor 3; c: main 2.
    assert m["agent_tokens/main"] == 14 and m["agent_tokens/compactor"] == 6
    assert m["agent_tokens/subagent"] == 11 and m["agent_tokens"] == 31
    assert m["agent_tokens"] == sum(t.num_agent_tokens for t in (a, b, c))
    assert m["attempts"] == 3 and m["episodes_per_trace"] == pytest.approx(9 / 3)
    assert m["episodes/main"] == pytest.approx(5 / 3)
    assert m["episodes/compactor"] == pytest.approx(2 / 3)
    assert m["episodes/subagent"] == pytest.approx(2 / 3)
    assert m["compactions_per_attempt"] == pytest.approx((3 + 1 + 0) / 3)
    assert m["memos_judged"] == 3 and m["memo_fidelity"] == pytest.approx(2 / 3)
    assert all(isinstance(v, float) for v in m.values())
    unjudged = trace_agent_metrics([_trace(0, 1.0, ["main", "compactor"], [COMPACTION])])
    assert "memo_fidelity" not in unjudged and unjudged["memos_judged"] == 0
    assert unjudged["compactions_per_attempt"] == 1
    assert trace_agent_metrics([]) == {"attempts": 0.0, "episodes_per_trace": 0.0,
                                       "agent_tokens": 0.0, "compactions_per_attempt": 0.0,
                                       "memos_judged": 0.0}


def test_staleness_histogram_has_every_bin_up_to_the_largest_lag():
    traces = [_trace(i, 1.0, ["main"], version=v) for i, v in enumerate([5, 5, 3, 2, 7])]
    traces.append(Trace(task_id="t", attempt_id="x", status="infra_error"))  # no version
    assert staleness_histogram(traces, 5) == {"staleness_hist/0": 3.0, "staleness_hist/1": 0.0,
                                              "staleness_hist/2": 1.0, "staleness_hist/3": 1.0}
    assert staleness_histogram(traces[-1:], 5) == {}


def test_staleness_histogram_counts_the_lag_of_what_trains():
    """As the staleness rule (issue 61): an old episode of an agent that does not train
    leaves the attempt's lag where its trained completions put it."""
    t = Trace(task_id="t", attempt_id="0", group_id="g", reward=1.0, status="finished")
    rec = TraceRecorder(t)
    rec.record("main", Completion([1, 2], [3, 4], [-0.5, -0.5], policy_version=4))
    rec.record("compactor", Completion([7, 8], [9], [-0.5], policy_version=1))
    assert staleness_histogram([t], 4) == {f"staleness_hist/{i}": float(i == 3)
                                           for i in range(4)}
    assert staleness_histogram([t], 4, train_agents=("main",)) == {"staleness_hist/0": 1.0}


@pytest.mark.parametrize("layout", ["flat", "tree"])
def test_trained_tokens_per_group_are_the_batch_tokens(layout):
    """trained_tokens/<group> sums to the batch's loss_mask (tree merges count their
    multiplicity); an excluded group logs 0; a cut end leaves its group's count."""
    agents = ["main", "compactor", "main", "subagent:helper"]
    traces = [_trace(0, 1.0, agents), _trace(1, 0.0, agents)]
    for i, t in enumerate(traces):  # the first main episode's next request (3 more tokens)
        first = 100 * (i + 1)
        TraceRecorder(t).record("main", Completion([1, 2, 3, first, first + 1, 9], [7, 7, 7],
                                                   [-0.5] * 3))
    batch, stats, _ = build_batch(traces, 0, BatchConfig(seq_len=16, layout=layout))
    m = batch_metrics(stats)
    assert sum(v for k, v in m.items() if k.startswith("trained_tokens/")) == batch.loss_mask.sum()
    main = sum(e.num_agent_tokens for t in traces for e in t.episodes if e.agent == "main")
    assert m["trained_tokens/main"] == main and m["trained_tokens/subagent"] == 2 * 5
    assert m["trained_tokens/compactor"] == 2 * 3 and m["traces"] == 2.0
    _, stats, _ = build_batch(traces, 0, BatchConfig(seq_len=16, layout=layout,
                                                     train_agents=("main", "subagent:*")))
    m = batch_metrics(stats)
    assert m["trained_tokens/compactor"] == 0 and m["excluded_agent_tokens"] == 2 * 3
    assert m["trained_tokens/main"] == main
    # Past max_seq_len the end of the long main episode is cut: its group loses those tokens.
    long = _trace(2, 1.0, ["compactor"])
    TraceRecorder(long).record("main", Completion(list(range(1, 21)), [5] * 6, [-0.5] * 6))
    batch, stats, _ = build_batch([long], 0, BatchConfig(seq_len=8, max_seq_len=22,
                                                         layout=layout))
    m = batch_metrics(stats)
    assert stats.truncated_agent_tokens == 4 and m["trained_tokens/main"] == 2
    assert m["trained_tokens/compactor"] == 2 and batch.loss_mask.sum() == 4


def test_metrics_logger_writes_the_families_under_the_train_prefix(tmp_path):
    traces = [_trace(0, 1.0, ["main", "compactor", "main"], EVENTS, version=1),
              _trace(1, 0.0, ["main", "subagent:helper"], version=0)]
    _, stats, _ = build_batch(traces, 1, BatchConfig(seq_len=16))
    m = {**trace_agent_metrics(traces), **batch_metrics(stats), **staleness_histogram(traces, 1)}
    logger = MetricsLogger(str(tmp_path), tensorboard=True, console=False)
    logger.log(3, m, prefix="train")
    logger.close()
    (line,) = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert line["step"] == 3 and not logger.dropped
    for k, v in m.items():
        assert line[f"train/{k}"] == pytest.approx(v)
    assert line["train/staleness_hist/0"] == 1 and line["train/staleness_hist/1"] == 1
    assert line["train/memo_fidelity"] == 0.5 and line["train/trained_tokens/subagent"] == 3
    assert json.loads(json.dumps(line)) == line
    assert list((tmp_path / "tensorboard").iterdir())  # TensorBoard took the keys too
    assert np.isfinite(list(m.values())).all()
