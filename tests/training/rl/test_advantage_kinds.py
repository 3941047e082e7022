"""The advantage estimators (issue 64) against numpy references written from their papers'
formulas (float64, exact up to 1e-12), and what the batch does with them: tied groups,
the zero-advantage counters, DAPO's overlong shaping."""

import numpy as np
import pytest

from ac2_jax.config import ConfigError, from_config
from ac2_jax.training import BatchConfig, RLConfig
from ac2_jax.training.rl import (
    ADVANTAGE_ESTIMATORS,
    DrGRPOAdvantage,
    GRPOAdvantage,
    OverlongShaping,
    ReinforceAdvantage,
    ReinforcePPAdvantage,
    RLOOAdvantage,
    batch_segments,
    trace_advantages,
)
from tests.support.rl_traces import rl_trace

# three groups: spread (4 attempts), tied at 0.7 (3), lone (1)
R = np.array([1.0, 0.0, 0.25, 0.5, 0.7, 0.7, 0.7, 0.3])
G = ["a", "a", "a", "a", "b", "b", "b", "c"]


def test_grpo_and_dr_grpo():
    """DeepSeekMath 4.1.2: (r - mean) / std per group; Dr. GRPO eq. 2: r - mean."""
    a = R[:4]
    want = np.concatenate([a - a.mean(), np.zeros(4)])
    np.testing.assert_allclose(GRPOAdvantage()(R, G), want, atol=1e-12)
    np.testing.assert_allclose(DrGRPOAdvantage()(R, G), want, atol=1e-12)
    std = np.concatenate([(a - a.mean()) / (a.std() + 1e-6), np.zeros(4)])
    np.testing.assert_allclose(GRPOAdvantage()(R, G, normalize_std=True), std, atol=1e-12)
    # the tied group is exactly 0 (0.7 has no exact binary form), not ~1e-17
    assert np.all(GRPOAdvantage()(R, G, normalize_std=True)[4:] == 0.0)


def test_rloo_leaves_each_attempt_out_of_its_baseline():
    """Kool et al. 2019 / Ahmadian et al. 2024 eq. 7: A_i = R_i - 1/(k-1) sum_{j!=i} R_j."""
    a = R[:4]
    loo = np.array([a[i] - np.delete(a, i).mean() for i in range(4)])
    np.testing.assert_allclose(RLOOAdvantage()(R, G), np.concatenate([loo, np.zeros(4)]),
                               atol=1e-12)


def test_reinforce_and_reinforce_pp():
    """Williams 1992: A = R - b. REINFORCE++ eq. 8-9: (R - mean_B) / std_B over the batch;
    -baseline: (R - mean_g) / std_B of those."""
    np.testing.assert_allclose(ReinforceAdvantage()(R, G), R, atol=1e-12)
    np.testing.assert_allclose(ReinforceAdvantage(baseline=0.5)(R, G), R - 0.5, atol=1e-12)
    np.testing.assert_allclose(ReinforcePPAdvantage()(R, G), (R - R.mean()) / (R.std() + 1e-6),
                               atol=1e-12)
    g = GRPOAdvantage()(R, G)
    np.testing.assert_allclose(ReinforcePPAdvantage(group_baseline=True)(R, G),
                               g / (g.std() + 1e-6), atol=1e-12)
    assert np.all(ReinforcePPAdvantage()(np.full(5, 0.7), list("abcde")) == 0.0)


def test_kinds_from_config_and_what_they_refuse():
    assert set(ADVANTAGE_ESTIMATORS.names()) == {"grpo", "dr_grpo", "rloo", "reinforce",
                                                 "reinforce_pp"}
    assert RLConfig().batch.advantage == GRPOAdvantage()  # today's default
    cfg = from_config(RLConfig, {"batch": {"advantage": {"kind": "reinforce_pp",
                                                         "group_baseline": True}}})
    assert cfg.batch.advantage == ReinforcePPAdvantage(group_baseline=True)
    for kind in ("dr_grpo", "rloo", "reinforce", "reinforce_pp"):
        with pytest.raises(ConfigError, match=f"advantage kind '{kind}' has no such step"):
            from_config(RLConfig, {"batch": {"advantage": {"kind": kind}, "normalize_std": True}})
    with pytest.raises(ConfigError, match=r"unknown key for GRPOAdvantage \(it takes no fields\)"):
        from_config(RLConfig, {"batch": {"advantage": {"group_baseline": True}}})
    for kind in ("dr_grpo", "rloo", "reinforce", "reinforce_pp"):
        # the sample std (std_ddof=1) is a setting of GRPO's std only: named, never ignored
        with pytest.raises(ConfigError, match=f"std_ddof=1.*advantage kind '{kind}'"):
            from_config(RLConfig, {"batch": {"advantage": {"kind": kind}, "std_ddof": 1}})


def traces(rewards_by_task):
    return [rl_trace(task, i, r) for task, rs in rewards_by_task.items() for i, r in enumerate(rs)]


def test_the_batch_counts_groups_by_their_advantages():
    """A tied group is a zero-advantage group under GRPO / RLOO (dropped with
    drop_zero_advantage), but REINFORCE (no baseline) still trains it."""
    ts = traces({"t0": [1.0, 0.0], "t1": [0.7, 0.7]})
    for est, zero, kept in ((GRPOAdvantage(), 1, 2), (RLOOAdvantage(), 1, 2),
                            (ReinforceAdvantage(), 0, 4)):
        cfg = BatchConfig(seq_len=16, rows=4, advantage=est, drop_zero_advantage=True)
        segs, stats, adv = batch_segments(ts, 0, cfg)
        assert stats.zero_advantage_groups == zero and len(adv) == kept
        assert stats.dropped_zero_advantage == 4 - kept
        want = {"GRPOAdvantage": [0.5, -0.5], "RLOOAdvantage": [1.0, -1.0],
                "ReinforceAdvantage": [1.0, 0.0, 0.7, 0.7]}[type(est).__name__]
        np.testing.assert_allclose(adv, want, atol=1e-7)
        np.testing.assert_allclose(adv, trace_advantages(ts[:kept], estimator=est), atol=0)


def test_overlong_shaping_follows_dapo_eq_13():
    """L <= Lmax - Lcache: 0; up to Lmax: ((Lmax - Lcache) - L) / Lcache; past Lmax: -1."""
    o = OverlongShaping(max_tokens=10, cache=4)
    assert [o.penalty(n) for n in (3, 6, 7, 9, 10, 11)] == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    ts = [rl_trace("t", i, 1.0, n_out=n) for i, n in enumerate((3, 8, 12))]
    cfg = BatchConfig(seq_len=32, rows=4, overlong=o)
    _, stats, adv = batch_segments(ts, 0, cfg)
    shaped = np.array([1.0, 0.5, 0.0])
    np.testing.assert_allclose(adv, shaped - shaped.mean(), atol=1e-7)
    assert stats.overlong_shaped == 2 and stats.overlong_penalty == pytest.approx(-1.5)
    with pytest.raises(ValueError, match="cache <= max_tokens"):
        OverlongShaping(max_tokens=4, cache=8)
