"""Confidence intervals against known values."""

import numpy as np
import pytest

from ac2_jax.evals import mean_interval, paired_difference, wilson_interval


def test_wilson_interval_known_values():
    e = wilson_interval(50, 100)
    assert e.mean == 0.5
    assert e.low == pytest.approx(0.4038, abs=1e-4) and e.high == pytest.approx(0.5962, abs=1e-4)
    e0 = wilson_interval(0, 20)
    assert e0.low == 0.0 and 0.1 < e0.high < 0.2
    with pytest.raises(ValueError):
        wilson_interval(1, 0)


def test_mean_and_paired_difference():
    x = [1.0, 2.0, 3.0, 4.0, 5.0]
    e = mean_interval(x)
    se = np.std(x, ddof=1) / np.sqrt(5)
    assert e.mean == 3.0 and e.high - 3.0 == pytest.approx(2.776 * se, rel=1e-6)
    d = paired_difference([1, 1, 1, 0] * 50, [0, 1, 0, 0] * 50)
    assert d.mean == pytest.approx(0.5) and d.excludes_zero()
    assert not paired_difference([1, 0] * 10, [0, 1] * 10).excludes_zero()
    with pytest.raises(ValueError, match="pair"):
        paired_difference([1, 2], [1])
