"""Which traces train: failure taxonomy and staleness rules, group advantages, BatchConfig.

The traces -> segments -> packed batch part (`batching`) has its own file,
tests/training/rl/test_rl_batching.py.
"""

import collections
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ac2_jax.config import ConfigError, from_config
from ac2_jax.losses import aggregate_loss
from ac2_jax.training.rl import batching
from ac2_jax.training.rl.batching import build_batch
from ac2_jax.training.rl.data import (
    BatchConfig,
    agent_trained,
    select_traces,
    trace_advantages,
    trace_version,
)
from ac2_jax.training.rl.trainer import RLConfig
from tests.support.rl_traces import rl_trace as _trace


def test_advantages_per_group():
    traces = [_trace("a", 0, 1.0), _trace("a", 1, 0.0), _trace("b", 0, 1.0), _trace("b", 1, 1.0)]
    np.testing.assert_allclose(trace_advantages(traces), [0.5, -0.5, 0.0, 0.0])


def test_tied_groups_train_exactly_nothing_and_std_is_population_or_sample():
    """Issue 61: 8 attempts all rewarded 0.7 (fp32 cannot hold it) get advantage exactly 0,
    with and without normalize_std, and are counted tied; normalize_std divides by the
    population std (std_ddof=0, the default) or the sample std (std_ddof=1)."""
    traces = [_trace("a", i, 0.7) for i in range(8)] + [
        _trace("b", i, r) for i, r in enumerate([0.2, 0.5, 0.9])]
    rb = np.array([0.2, 0.5, 0.9])
    for ddof in (0, 1):
        for std in (False, True):
            adv = trace_advantages(traces, std, ddof)
            assert adv.dtype == np.float32 and np.all(adv[:8] == 0.0)
            want = (rb - rb.mean()) / ((rb.std(ddof=ddof) + 1e-6) if std else 1.0)
            np.testing.assert_allclose(adv[8:], want, rtol=1e-6)
    segments, stats, _ = batching.batch_segments(traces, 0, BatchConfig(seq_len=32,
                                                                        normalize_std=True))
    assert stats.zero_advantage_groups == 1
    assert all(s.features["advantages"][0] == 0.0 for s in segments if s.task.startswith("a"))
    with pytest.raises(ValueError, match="std_ddof"):
        BatchConfig(std_ddof=2)


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
    agent_adv = np.round(batch.features["advantages"][batch.loss_mask > 0], 6)
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


def test_bad_weights_and_lengths_are_refused():
    with pytest.raises(ValueError, match="stale_weight"):
        BatchConfig(stale_weight=-0.5)
    with pytest.raises(ValueError, match="max_seq_len"):
        BatchConfig(seq_len=64, max_seq_len=32)


def test_bad_policies():
    for old in ("zero", "drop"):  # the old failure switch: a clear error, not a silent change
        with pytest.raises(ValueError, match="agent_error_reward.*timed_out_reward"):
            BatchConfig(failed=old)
    with pytest.raises(ValueError, match="timed_out_reward"):
        BatchConfig(timed_out_reward=float("nan"))
    with pytest.raises(ValueError, match="stale"):
        BatchConfig(stale="ignore")


def test_train_agents_is_checked_and_read_from_configs():
    for bad, match in ((["main"], "must be a tuple"), ("main", "must be a tuple"),
                       ((), "train nothing"), (("main", ""), "not an agent label"),
                       (("sub*",), "only wildcard")):
        with pytest.raises(ValueError, match=match) as e:
            BatchConfig(train_agents=bad)
        assert 'train_agents=("main",)' in str(e.value)  # says what to pass
    assert BatchConfig().train_agents is None
    for agents in (["main"], ("main",)):
        rl = from_config(RLConfig, {"batch": {"train_agents": agents}}, path="rl")
        assert rl.batch.train_agents == ("main",)
    ml_collections = pytest.importorskip("ml_collections")
    cfg = ml_collections.ConfigDict({"batch": {"train_agents": ("main", "subagent:*")}})
    assert from_config(RLConfig, cfg, path="rl").batch.train_agents == ("main", "subagent:*")
    with pytest.raises(ConfigError, match=r"rl\.batch\.train_agents"):
        from_config(RLConfig, {"batch": {"train_agents": "main"}}, path="rl")
    with pytest.raises(ConfigError, match="train nothing"):
        from_config(RLConfig, {"batch": {"train_agents": []}}, path="rl")


def test_subagent_wildcard_and_exact_labels():
    assert agent_trained("main", None) and agent_trained("compactor", None)
    assert agent_trained("subagent:helper", ("main", "subagent:*"))
    assert not agent_trained("subagent", ("subagent:*",))  # not a subagent:<name> label
    assert not agent_trained("compactor", ("main", "subagent:*"))
    assert agent_trained("subagent:calc", ("subagent:calc",))
    assert not agent_trained("subagent:helper", ("subagent:calc",))


def test_a_trace_without_completions_is_never_stale_and_stays_in_its_baseline():
    """Finding 3 (issue 32): a trace with no sampled token had policy version 0, so
    under bounded staleness it was dropped as stale and left its group's baseline."""
    from ac2_jax.trace import Trace
    failed_early = Trace(task_id="a", attempt_id="9", group_id="g:a", reward=0.0,
                         status="agent_error")  # failed before calling the model
    traces = [_trace("a", 0, 1.0, version=5), _trace("a", 1, 1.0, version=5), failed_early]
    assert trace_version(failed_early) is None
    kept, w, stats = select_traces(traces, 5, BatchConfig(max_staleness=1, stale="drop"))
    assert [t.attempt_id for t in kept] == ["0", "1", "9"] and stats.dropped_stale == 0
    assert stats.no_completions == 1 and stats.staleness_max == 0 and w == [1.0] * 3
    np.testing.assert_allclose(trace_advantages(kept), [1 / 3, 1 / 3, -2 / 3], rtol=1e-6)
    batch, stats, adv = build_batch(traces, 5, BatchConfig(seq_len=16, max_staleness=1))
    assert batch.loss_mask.sum() == 6 and stats.no_completions == 1  # it trains no token
    np.testing.assert_allclose(sorted(set(np.round(batch.features["advantages"][batch.loss_mask > 0], 6))),
                               [round(1 / 3, 6)])


def test_staleness_is_judged_on_the_completions_that_train():
    """Issue 61: an unchosen response and an episode of an agent that does not train
    sampled by an old policy do not make the attempt stale: only trained completions
    count. A trace whose trained completions are stale is still dropped (or
    down-weighted), and a trace none of whose completions trains has no version."""
    from ac2_jax.trace import Completion, Trace, TraceRecorder

    def attempt(i, unchosen_version, compactor_version, chosen_version=3):
        t = Trace(task_id="a", attempt_id=str(i), group_id="g:a", reward=float(i % 2),
                  status="finished")
        rec = TraceRecorder(t)
        for k, v in ((0, unchosen_version), (1, chosen_version)):  # n = 2, response 1 chosen
            rec.record("main", Completion([1, 2, 3], [10 + k, 11], [-0.5, -0.5],
                                          policy_version=v, request_id="r0", choice_index=k))
        rec.record("compactor", Completion([5, 6], [20, 21], [-0.5, -0.5],
                                           policy_version=compactor_version))
        t.metadata = {"artifacts": {"metrics": {"branch_choices": [
            {"request_id": "r0", "index": 1}]}}}
        return t

    cfg = BatchConfig(seq_len=32, rows=1, max_staleness=1, train_agents=("main",))
    old = [attempt(0, 0, 0), attempt(1, 0, 0)]  # learner 3: the old completions lag 3
    kept, _, stats = select_traces(old, 3, cfg)
    assert len(kept) == 2 and stats.dropped_stale == 0
    assert stats.staleness_max == 0 and stats.staleness_mean == 0.0
    # The compactor trains too: its old completion makes the attempt stale.
    kept, _, stats = select_traces(old, 3, dataclasses.replace(cfg, train_agents=None))
    assert kept == [] and stats.dropped_stale == 2 and stats.staleness_max == 3
    # The chosen response itself is stale: dropped whatever else the trace holds.
    stale = [attempt(0, 3, 3, chosen_version=0), attempt(1, 3, 3, chosen_version=0)]
    kept, _, stats = select_traces(stale, 3, cfg)
    assert kept == [] and stats.dropped_stale == 2
    segments, stats, _ = batching.batch_segments(old, 3, cfg)
    assert len(segments) == 2 and stats.dropped_stale == 0 and stats.unchosen_responses == 2
    # Nothing of it trains (a compactor-only attempt, main-only training): no version,
    # never stale, in its baseline; it called the model, so not in no_completions.
    only = Trace(task_id="a", attempt_id="9", group_id="g:a", reward=1.0, status="finished")
    TraceRecorder(only).record("compactor", Completion([5, 6], [20], [-0.5], policy_version=0))
    kept, _, stats = select_traces([only], 3, cfg)
    assert kept == [only] and stats.dropped_stale == 0 and stats.no_completions == 0
    assert stats.empty == 0  # it holds agent tokens; the train_agents filter leaves them out


# --- A property test: random statuses, rewards, versions and configs against a small
# reference of the design's signal rules (docs/design.md "Signal rules").

def _reference(traces, learner, cfg):
    """What the rules say, written out directly: for each trace, dropped (and the
    counter it lands in) or kept (reward, weight); then advantages over the kept."""
    kept, skipped = {}, collections.Counter()
    for t in traces:
        if t.status == "finished":
            reward = t.reward if t.reward is not None else "dropped_no_reward"
        elif t.status == "agent_error":
            reward = cfg.agent_error_reward if cfg.agent_error_reward is not None else (
                t.reward or 0.0)
        elif t.status == "timed_out":
            reward = cfg.timed_out_reward if cfg.timed_out_reward is not None else (
                "dropped_timed_out")
        else:  # infra_error, or never ended
            reward = "infra_errors"
        if isinstance(reward, str):
            skipped[reward] += 1
            continue
        versions = [c.policy_version for e in t.episodes for c in e.completions]
        lag = learner - min(versions) if versions else 0  # no completion: never stale
        weight = 1.0
        if lag > cfg.max_staleness:
            if cfg.stale == "drop":
                skipped["dropped_stale"] += 1
                continue
            weight = cfg.stale_weight ** (lag - cfg.max_staleness)
        kept[t.key] = (t, float(reward), weight)
    means = collections.defaultdict(list)
    for t, r, _ in kept.values():
        means[t.group_id].append(r)
    out = {}
    for k, (t, r, w) in kept.items():
        group = np.asarray(means[t.group_id], np.float64)
        if len(set(group.tolist())) < 2:  # one reward (or one trace): exactly no signal
            adv = 0.0
        else:
            adv = r - group.mean()
            if cfg.normalize_std:
                adv /= group.std(ddof=cfg.std_ddof) + 1e-6
        out[k] = (adv, w, t.num_agent_tokens)
    return out, skipped


# Rewards the property test draws: the old three, values fp32 cannot hold (ties of them
# must stay exactly 0), and any multiple of 1/997 in [-1, 1] ("fraction of tests passed").
REWARDS = st.one_of(st.sampled_from([None, 0.0, 0.5, 1.0, 0.7, 0.1, 1 / 3]),
                    st.integers(-997, 997).map(lambda k: k / 997))


@settings(max_examples=250, deadline=None, database=None)
@given(st.data())
def test_what_trains_counts_and_is_skipped_follows_the_signal_rules(data):
    from ac2_jax.trace import TRACE_STATUSES, Trace
    learner = data.draw(st.integers(0, 4), label="learner version")
    cfg = BatchConfig(
        seq_len=32, rows=1,
        agent_error_reward=data.draw(st.sampled_from([None, 0.0, -1.0])),
        timed_out_reward=data.draw(st.sampled_from([None, 0.0, 0.25])),
        max_staleness=data.draw(st.integers(0, 2)),
        stale=data.draw(st.sampled_from(["drop", "downweight"])),
        normalize_std=data.draw(st.booleans(), label="normalize_std"),
        std_ddof=data.draw(st.sampled_from([0, 1]), label="std_ddof"))
    traces = []
    for g in range(data.draw(st.integers(1, 3), label="groups")):
        # Half the groups repeat one value: ties of floats fp32 cannot hold.
        tie = data.draw(REWARDS, label="group reward") if data.draw(st.booleans()) else None
        for a in range(data.draw(st.integers(1, 8), label="attempts")):
            status = data.draw(st.sampled_from(TRACE_STATUSES), label="status")
            reward = tie if tie is not None else data.draw(REWARDS, label="reward")
            if data.draw(st.booleans(), label="no completions"):
                traces.append(Trace(task_id=f"t{g}", attempt_id=str(a), group_id=f"g{g}",
                                    reward=reward, status=status))
            else:
                t = _trace(f"t{g}", a, reward, version=data.draw(st.integers(0, learner)),
                           status=status, n_out=data.draw(st.integers(1, 3)))
                t.group_id = f"g{g}"
                traces.append(t)
    want, skipped = _reference(traces, learner, cfg)
    segments, stats, adv_all = batching.batch_segments(traces, learner, cfg)
    kept, _, _ = select_traces(traces, learner, cfg)
    # What trains: each kept trace with tokens, all of them, at its advantage and weight.
    got = {s.task: (s.features["advantages"][0], s.weight, s.num_agent_tokens) for s in segments}
    assert set(got) == {k for k, (_, _, n) in want.items() if n}
    for k, (adv, w, n) in got.items():
        np.testing.assert_allclose((adv, w, n), want[k], rtol=1e-5, atol=1e-6)
        if want[k][0] == 0.0:  # a tie trains exactly nothing, not fp32 noise
            assert adv == 0.0, (k, adv)
    # The counters and the advantages agree: a group is counted tied iff its
    # advantages are all exactly 0.
    zero = collections.defaultdict(list)
    for t, a in zip(kept, adv_all, strict=True):
        zero[t.group_id].append(a == 0.0)
    assert stats.zero_advantage_groups == sum(all(z) for z in zero.values())
    # What is skipped: every trace is kept or lands in exactly one counter.
    assert {k: getattr(stats, k) for k in skipped} == dict(skipped)
    assert stats.traces == len(traces) == len(want) + sum(
        getattr(stats, k) for k in ("dropped_no_reward", "dropped_timed_out", "infra_errors",
                                    "dropped_stale"))
    by_key = {t.key: t for t in traces}
    assert stats.no_completions == sum(1 for k in want if not by_key[k].episodes)
    assert stats.empty == sum(1 for _, _, n in want.values() if n == 0)
    assert stats.downweighted == sum(1 for _, w, _ in want.values() if w < 1.0)
