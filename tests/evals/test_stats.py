"""Confidence intervals against textbook values and independent scipy references."""

import math

import numpy as np
import pytest
import scipy.stats

from ac2_jax.evals import (
    bootstrap_interval,
    clustered_interval,
    mean_interval,
    paired_difference,
    t_quantile,
    wilson_interval,
    z_quantile,
)

LEVELS = (0.8, 0.9, 0.95, 0.99)
# Two-sided Student-t critical values from printed t tables (3 decimals), dof 2, 9, 99.
T_TABLE = {0.80: (1.886, 1.383, 1.290), 0.90: (2.920, 1.833, 1.660),
           0.95: (4.303, 2.262, 1.984), 0.99: (9.925, 3.250, 2.626)}
Z_TABLE = {0.80: 1.2816, 0.90: 1.6449, 0.95: 1.9600, 0.99: 2.5758}


@pytest.mark.parametrize("level", LEVELS)
def test_quantiles_match_printed_tables(level):
    assert z_quantile(level) == pytest.approx(Z_TABLE[level], abs=5e-5)
    for dof, want in zip((2, 9, 99), T_TABLE[level]):
        assert t_quantile(dof, level) == pytest.approx(want, abs=5e-4)


def test_wilson_interval_known_values():
    e = wilson_interval(50, 100)
    assert (e.mean, e.method, e.n, e.level) == (0.5, "wilson", 100, 0.95)
    assert e.low == pytest.approx(0.4038, abs=1e-4) and e.high == pytest.approx(0.5962, abs=1e-4)
    e = wilson_interval(3, 10)  # the textbook 3/10 example
    assert e.low == pytest.approx(0.1078, abs=1e-4) and e.high == pytest.approx(0.6032, abs=1e-4)
    e0 = wilson_interval(0, 20)
    assert e0.low == 0.0 and 0.1 < e0.high < 0.2
    for bad in ((1, 0), (11, 10), (-1, 10)):
        with pytest.raises(ValueError):
            wilson_interval(*bad)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("c,n", [(1, 3), (3, 10), (37, 100), (0, 10), (10, 10)])
def test_wilson_matches_scipy_binomtest_at_any_level(level, c, n):
    e = wilson_interval(c, n, level)
    ref = scipy.stats.binomtest(c, n).proportion_ci(level, method="wilson")
    assert e.low == pytest.approx(ref.low, abs=1e-12)
    assert e.high == pytest.approx(ref.high, abs=1e-12)
    if c == 0:  # closed form: upper = z^2 / (n + z^2)
        z = Z_TABLE[level]
        assert e.high == pytest.approx(z * z / (n + z * z), abs=1e-4)


def test_t_interval_99_over_three_values_uses_two_dof():
    e = mean_interval([1.0, 2.0, 3.0], level=0.99)
    half = 9.925 * 1.0 / math.sqrt(3)  # t_{0.995, 2} * s / sqrt(n), s = 1
    assert e.method == "t" and e.mean == 2.0 and e.n == 3
    assert e.low == pytest.approx(2 - half, abs=1e-3)
    assert e.high == pytest.approx(2 + half, abs=1e-3)
    assert e.high - 2 > 2.5758 / math.sqrt(3) * 3  # far wider than a normal interval


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n", [3, 10, 100])
def test_t_interval_matches_scipy_and_the_table(level, n):
    x = np.random.default_rng(n).normal(5.0, 2.0, n)
    e = mean_interval(x, level)
    ref = scipy.stats.t.interval(level, n - 1, loc=x.mean(), scale=scipy.stats.sem(x))
    assert (e.low, e.high) == pytest.approx(ref, abs=1e-12)
    tab = T_TABLE[level][(3, 10, 100).index(n)]
    half = tab * x.std(ddof=1) / math.sqrt(n)
    assert e.high - e.mean == pytest.approx(half, rel=1e-3)


def test_mean_interval_edge_cases():
    x = [1.0, 2.0, 3.0, 4.0, 5.0]
    e = mean_interval(x)
    se = np.std(x, ddof=1) / np.sqrt(5)
    assert e.mean == 3.0 and e.high - 3.0 == pytest.approx(2.776 * se, rel=1e-3)
    one = mean_interval([0.5])
    assert one.low == -math.inf and one.to_dict()["low"] is None and one.to_dict()["mean"] == 0.5
    with pytest.raises(ValueError, match="non-empty"):
        mean_interval([])
    with pytest.raises(ValueError, match="finite"):
        mean_interval([1.0, float("nan")])
    with pytest.raises(ValueError, match="level"):
        mean_interval(x, level=95)


def test_bootstrap_is_seeded_and_close_to_t_for_normal_data():
    x = np.random.default_rng(0).normal(0.0, 1.0, 100)
    a = bootstrap_interval(x, 0.9, seed=3)
    assert a == bootstrap_interval(x, 0.9, seed=3) and a.method == "bootstrap"
    assert a != bootstrap_interval(x, 0.9, seed=4)
    t = mean_interval(x, 0.9)
    width = t.high - t.low
    assert abs(a.low - t.low) < 0.1 * width and abs(a.high - t.high) < 0.1 * width
    assert a.mean == pytest.approx(x.mean()) and a.low < a.mean < a.high
    with pytest.raises(ValueError, match="at least 2"):
        bootstrap_interval([1.0])


def test_clustered_interval_is_t_over_task_means():
    groups = [[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 1], [0, 0, 1, 0], [1, 1, 1, 0]]
    e = clustered_interval(groups, 0.9)
    ref = mean_interval([np.mean(g) for g in groups], 0.9)
    assert e.method == "clustered-t" and e.n == 5
    assert (e.mean, e.low, e.high) == pytest.approx((ref.mean, ref.low, ref.high), abs=1e-12)
    # Attempts of a task are correlated: treating all 20 as independent is too narrow.
    naive = mean_interval([v for g in groups for v in g], 0.9)
    assert e.high - e.low > 1.5 * (naive.high - naive.low)
    # Unequal group sizes: every task weighs the same.
    assert clustered_interval([[1.0], [0.0, 0.0, 0.0]]).mean == 0.5
    clipped = clustered_interval([[1, 1], [0, 1], [1, 1]], bounds=(0.0, 1.0))
    assert clipped.high == 1.0 and clipped.low >= 0.0
    with pytest.raises(ValueError, match="group 1"):
        clustered_interval([[1.0], []])


def test_paired_difference_is_paired_t_over_tasks():
    d = paired_difference([1, 1, 1, 0] * 50, [0, 1, 0, 0] * 50)
    assert d.mean == pytest.approx(0.5) and d.excludes_zero() and d.method == "paired-t"
    assert not paired_difference([1, 0] * 10, [0, 1] * 10).excludes_zero()
    after, before = [0.9, 0.8, 1.0, 0.7, 0.95], [0.5, 0.6, 0.7, 0.2, 0.65]
    ref = scipy.stats.ttest_rel(after, before).confidence_interval(0.95)
    e = paired_difference(after, before)
    assert (e.low, e.high) == pytest.approx((ref.low, ref.high), abs=1e-12)
    with pytest.raises(ValueError, match="pair"):
        paired_difference([1, 2], [1])
