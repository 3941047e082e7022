"""Traces -> RL batch: failure taxonomy and staleness rules, group advantages, packing."""

import dataclasses

import numpy as np
import pytest

from ac2_jax.losses import aggregate_loss
from ac2_jax.trace import Completion, Trace, TraceRecorder
from ac2_jax.training.rl.data import (BatchConfig, build_batch, informative_groups,
                                      select_traces, trace_advantages, trace_version)


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
    # Counts stay 1; the down-weighted trace's agent tokens carry its weight in loss_weight.
    assert set(batch.loss_mask[batch.loss_mask > 0].tolist()) == {1.0}
    assert sorted(set(batch.loss_weight[batch.loss_mask > 0].tolist())) == [0.25, 1.0]


def test_a_stale_trace_trains_with_w_times_the_loss():
    """Weights used to be folded into the count and cancelled in task_mean."""
    fresh, _, _ = build_batch([_trace("a", 0, 1.0, version=5)], 5, BatchConfig(seq_len=16))
    stale, stats, _ = build_batch([_trace("a", 0, 1.0, version=2)], 5,
                                  BatchConfig(seq_len=16, stale="downweight", stale_weight=0.5))
    assert stats.downweighted == 1
    per_token = np.linspace(0.5, 2.0, fresh.loss_mask.size, dtype=np.float32).reshape(fresh.shape)
    np.testing.assert_allclose(float(aggregate_loss(per_token, stale)),
                               0.25 * float(aggregate_loss(per_token, fresh)), rtol=1e-6)


def _long_episode_trace(n_requests=5, n_out=6, prompt=8):
    """One append-only episode of `n_requests` requests (each re-sends all before it)."""
    t = Trace(task_id="long", attempt_id="0", group_id="g:long", reward=1.0, status="finished")
    rec, ids = TraceRecorder(t), list(range(1, prompt + 1))
    for k in range(n_requests):
        out = [100 + 10 * k + i for i in range(n_out)]
        rec.record("main", Completion(list(ids), out, [-0.1 * (k + 1)] * n_out))
        ids = ids + out + [50 + k, 51 + k]  # a tool result before the next request
    return t


def test_a_long_episode_keeps_every_agent_token_in_a_grown_row():
    """Packing used truncate=True: the last turns (the answer) silently left the loss."""
    t = _long_episode_trace()
    assert len(t.episodes) == 1 and len(t.episodes[0].token_ids) == 8 + 5 * 6 + 4 * 2  # 46
    batch, stats, _ = build_batch([t, _trace("long", 1, 0.0)], 0, BatchConfig(seq_len=16, rows=1))
    assert batch.shape[1] == stats.row_len == 64 and stats.long_segments == 1
    assert stats.truncated_agent_tokens == 0
    from_long = (batch.loss_mask > 0) & (batch.advantages > 0)
    assert from_long.sum() == t.num_agent_tokens == 30
    assert sorted(batch.targets[from_long].tolist()) == sorted(
        x for c in t.episodes[0].completions for x in c.output_ids)
    np.testing.assert_allclose(sorted(batch.sampler_logprobs[from_long].tolist()),
                               sorted(-0.1 * (k + 1) for k in range(5) for _ in range(6)), rtol=1e-6)


def test_past_max_seq_len_the_end_is_cut_and_counted():
    t = _long_episode_trace()
    batch, stats, _ = build_batch([t], 0, BatchConfig(seq_len=16, max_seq_len=32, rows=1))
    # Tokens 32..45 leave the loss: the outputs of requests 4 (at 32..37) and 5 (40..45).
    assert stats.row_len == 32 and stats.truncated_segments == 1
    assert stats.truncated_agent_tokens == 12
    assert batch.loss_mask.sum() == t.num_agent_tokens - 12


def test_bad_weights_and_lengths_are_refused():
    with pytest.raises(ValueError, match="stale_weight"):
        BatchConfig(stale_weight=-0.5)
    with pytest.raises(ValueError, match="max_seq_len"):
        BatchConfig(seq_len=64, max_seq_len=32)


def test_greedy_rollouts_are_refused_for_rl():
    t = _trace("a", 0, 1.0)
    t.episodes[0].completions[0].temperature = 0.0
    with pytest.raises(ValueError, match="temperature > 0"):
        build_batch([t, _trace("a", 1, 0.0)], 0, BatchConfig(seq_len=16))


def test_two_traces_with_one_key_are_refused():
    with pytest.raises(ValueError, match="share the key"):
        build_batch([_trace("a", 0, 1.0), _trace("a", 0, 0.0)], 0, BatchConfig(seq_len=16))


def test_sampling_params_reach_the_batch():
    t = _trace("a", 0, 1.0)
    c = t.episodes[0].completions[0]
    c.temperature, c.top_k, c.top_p = 0.3, 20, 0.9
    for layout in ("flat", "tree"):
        batch, _, _ = build_batch([t, _trace("a", 1, 0.0)], 0, BatchConfig(seq_len=16, layout=layout))
        first = (batch.loss_mask > 0) & (batch.advantages > 0)
        assert first.sum() == 3
        np.testing.assert_allclose(batch.temperature[first], 0.3, rtol=1e-6)
        assert (batch.top_k[first] == 20).all()
        np.testing.assert_allclose(batch.top_p[first], 0.9, rtol=1e-6)


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


def test_a_trace_left_alone_in_its_group_gets_advantage_0_and_is_counted():
    traces = [_trace("a", 0, 1.0), _trace("a", 1, 0.0, status="infra_error"), _trace("b", 0, 0.0),
              _trace("b", 1, 1.0)]
    batch, stats, adv = build_batch(traces, 0, BatchConfig(seq_len=16, rows=2))
    np.testing.assert_allclose(adv, [0.0, -0.5, 0.5])
    assert stats.lone_traces == 1 and stats.infra_errors == 1


def test_zero_advantage_groups_are_counted_and_left_out_on_request():
    """a: all solved, c: one kept trace (the other infra_error): no advantage.
    b: a reward spread. e: 0 and an agent_error, equal unless agent_error_reward differs."""
    traces = [_trace("a", 0, 1.0), _trace("a", 1, 1.0), _trace("b", 0, 1.0, n_out=4),
              _trace("b", 1, 0.0, n_out=5), _trace("c", 0, 0.0),
              _trace("c", 1, 1.0, status="infra_error"), _trace("e", 0, 0.0),
              _trace("e", 1, 0.0, status="agent_error")]
    kept, _, _ = select_traces(traces, 0, BatchConfig())
    assert informative_groups(kept) == {"g:b"}
    kept, _, _ = select_traces(traces, 0, BatchConfig(agent_error_reward=-1.0))
    assert informative_groups(kept) == {"g:b", "g:e"}  # the failure rules decide the reward

    config = BatchConfig(seq_len=16, rows=2)
    full, stats, _ = build_batch(traces, 0, config)
    assert stats.zero_advantage_groups == 3 and stats.dropped_zero_advantage == 0
    assert full.loss_mask.sum() == 3 + 3 + 4 + 5 + 3 + 3 + 3
    dropped, stats, adv = build_batch(traces, 0, dataclasses.replace(config,
                                                                     drop_zero_advantage=True))
    assert stats.zero_advantage_groups == 3 and stats.dropped_zero_advantage == 5
    assert stats.infra_errors == 1 and stats.traces == 8  # counters still see every trace
    np.testing.assert_allclose(adv, [0.5, -0.5])
    assert dropped.loss_mask.sum() == 4 + 5
    # b's tokens train with the same advantages either way (tolerance 1e-6).
    for batch in (full, dropped):
        got = sorted(np.round(batch.advantages[batch.loss_mask > 0], 6).tolist())
        assert [a for a in got if a != 0.0] == [-0.5] * 5 + [0.5] * 4
    none, stats, _ = build_batch(traces[:2], 0, dataclasses.replace(config,
                                                                    drop_zero_advantage=True))
    assert none is None and stats.dropped_zero_advantage == 2


@pytest.mark.parametrize("layout", ["flat", "tree"])
def test_rows_past_the_config_grow_in_powers_of_two_of_it(layout):
    """The calculator demo compiled its RL step 4 times: rows followed the data (8, 9,
    10, 11...). Past `rows` they now grow to rows x 2^k (few geometries), and the
    padding rows carry nothing."""
    shapes, masks = set(), set()
    for n in range(3, 12):  # 3..11 traces of 10 tokens, one per 16-token row (no sharing)
        traces = [_trace(f"t{i}", i, float(i % 2), n_out=7) for i in range(n)]
        for k, t in enumerate(traces):  # distinct prompts: nothing for a tree to share
            t.episodes[0].token_ids[0] = 100 + k
        batch, _, _ = build_batch(traces, 0, BatchConfig(seq_len=16, rows=4, layout=layout))
        shapes.add(batch.shape)
        masks.add(float(batch.loss_mask.sum()))
        assert float(batch.loss_mask.sum()) == 7 * n
    assert shapes == {(4, 16), (8, 16), (16, 16)}, shapes
