"""Traces -> RL batch: failure and staleness rules, group advantages, packing."""

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


def test_failed_rollouts_zero_or_drop():
    traces = [_trace("a", 0, 1.0), _trace("a", 1, None, status="failed")]
    kept, w, stats = select_traces(traces, 0, BatchConfig(failed="zero"))
    assert len(kept) == 2 and stats.failed == 1 and stats.dropped_failed == 0
    np.testing.assert_allclose(trace_advantages(kept), [0.5, -0.5])
    kept, w, stats = select_traces(traces, 0, BatchConfig(failed="drop"))
    assert len(kept) == 1 and stats.failed == 1 and stats.dropped_failed == 1


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
    none, stats, _ = build_batch([_trace("a", 0, None, status="failed")], 0,
                                 BatchConfig(failed="drop"))
    assert none is None and stats.dropped_failed == 1


def test_bad_policies():
    with pytest.raises(ValueError, match="failed"):
        BatchConfig(failed="retry")
    with pytest.raises(ValueError, match="stale"):
        BatchConfig(stale="ignore")
