"""Traces -> RL batch: failure taxonomy and staleness rules, group advantages, packing."""

import numpy as np
import pytest

from ac2_jax.trace import Completion, Trace, TraceRecorder
from ac2_jax.training.rl_data import (BatchConfig, build_batch, select_traces, trace_advantages,
                                      trace_version)


def _trace(task, attempt, reward, version=0, status="finished", n_out=3):
    t = Trace(task_id=task, attempt_id=str(attempt), group_id=f"g:{task}", reward=reward,
              status=status)
    TraceRecorder(t).record("main", Completion([1, 2, 3], list(range(10, 10 + n_out)),
                                               [-0.5] * n_out, policy_version=version))
    return t


def test_advantages_per_group():
    traces = [_trace("a", 0, 1.0), _trace("a", 1, 0.0), _trace("b", 0, 1.0), _trace("b", 1, 1.0)]
    np.testing.assert_allclose(trace_advantages(traces), [0.5, -0.5, 0.0, 0.0])


def test_failure_taxonomy():
    """finished trains (wrong answers too), agent_error trains, timed_out is configurable,
    infra_error (and anything not ended) never trains; every skip is counted."""
    traces = [_trace("a", 0, 1.0), _trace("a", 1, 0.0),  # right and wrong: both finished
              _trace("a", 2, 0.0, status="agent_error"), _trace("a", 3, None, status="timed_out"),
              _trace("a", 4, 1.0, status="infra_error"), _trace("a", 5, None, status="running"),
              _trace("a", 6, None)]  # finished, but nobody gave a reward
    kept, _, stats = select_traces(traces, 0, BatchConfig())
    assert [t.attempt_id for t in kept] == ["0", "1", "2"]
    assert (stats.finished, stats.agent_errors, stats.timed_out, stats.dropped_timed_out,
            stats.infra_errors, stats.dropped_no_reward) == (3, 1, 1, 1, 2, 1)
    np.testing.assert_allclose(trace_advantages(kept), [2 / 3, -1 / 3, -1 / 3], rtol=1e-6)

    config = BatchConfig(agent_error_reward=-1.0, timed_out_reward=0.0)
    kept, _, stats = select_traces(traces, 0, config)
    assert [(t.attempt_id, t.reward) for t in kept] == [("0", 1.0), ("1", 0.0), ("2", -1.0),
                                                        ("3", 0.0)]
    assert stats.dropped_timed_out == 0 and stats.infra_errors == 2
    assert traces[2].reward == 0.0 and traces[3].reward is None  # the inputs are unchanged


def test_wrong_answer_trains_with_negative_advantage_and_infra_error_never_does():
    traces = [_trace("a", 0, 1.0), _trace("a", 1, 0.0, n_out=4),
              _trace("a", 2, 1.0, status="infra_error", n_out=5)]
    batch, stats, adv = build_batch(traces, 0, BatchConfig(seq_len=16, rows=3))
    np.testing.assert_allclose(adv, [0.5, -0.5])
    assert batch.loss_mask.sum() == 3 + 4 and stats.infra_errors == 1
    agent_adv = np.round(batch.advantages[batch.loss_mask > 0], 6)
    assert sorted(agent_adv.tolist()) == [-0.5] * 4 + [0.5] * 3
    none, stats, _ = build_batch(traces[2:], 0, BatchConfig(seq_len=16))
    assert none is None and stats.infra_errors == 1


def test_staleness_drop_and_downweight():
    traces = [_trace("a", 0, 1.0, version=5), _trace("a", 1, 0.0, version=4),
              _trace("a", 2, 0.0, version=2)]
    assert [trace_version(t) for t in traces] == [5, 4, 2]
    kept, w, stats = select_traces(traces, 5, BatchConfig(max_staleness=1, stale="drop"))
    assert [t.attempt_id for t in kept] == ["0", "1"] and stats.dropped_stale == 1
    assert stats.staleness_max == 3
    kept, w, stats = select_traces(traces, 5, BatchConfig(max_staleness=1, stale="downweight",
                                                          stale_weight=0.5))
    assert len(kept) == 3 and w == [1.0, 1.0, 0.25] and stats.downweighted == 1
    batch, _, _ = build_batch(traces, 5, BatchConfig(seq_len=16, max_staleness=1,
                                                      stale="downweight", stale_weight=0.5))
    # The down-weighted trace's agent tokens carry its weight in the loss mask.
    assert sorted(set(batch.loss_mask[batch.loss_mask > 0].tolist())) == [0.25, 1.0]


def test_build_batch_shapes_and_advantages():
    traces = [_trace("a", i, float(i % 2), n_out=2 + i) for i in range(4)]
    batch, stats, adv = build_batch(traces, 0, BatchConfig(seq_len=16, rows=4))
    assert batch.shape == (4, 16) and stats.traces == 4
    assert batch.loss_mask.sum() == sum(2 + i for i in range(4))
    assert set(np.round(batch.advantages[batch.loss_mask > 0], 6)) == {-0.5, 0.5}
    tree, _, _ = build_batch(traces, 0, BatchConfig(seq_len=64, rows=1, layout="tree"))
    assert tree.subtree_end is not None and tree.num_real_tokens < batch.num_real_tokens


def test_bad_policies():
    for old in ("zero", "drop"):  # the old failure switch: a clear error, not a silent change
        with pytest.raises(ValueError, match="agent_error_reward.*timed_out_reward"):
            BatchConfig(failed=old)
    with pytest.raises(ValueError, match="timed_out_reward"):
        BatchConfig(timed_out_reward=float("nan"))
    with pytest.raises(ValueError, match="stale"):
        BatchConfig(stale="ignore")
