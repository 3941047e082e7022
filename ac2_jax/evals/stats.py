"""Confidence intervals for eval results (pure numpy).

Pass rates get the Wilson score interval (well-behaved near 0 and 1); a
difference of two pass rates measured on the same tasks gets a paired
normal interval; general means get a t-based interval. All 95% by default.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

_Z = {0.90: 1.6448536, 0.95: 1.9599640, 0.99: 2.5758293}


def _z(level: float) -> float:
    if level not in _Z:
        raise ValueError(f"confidence level must be one of {sorted(_Z)}, got {level}")
    return _Z[level]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A mean with its confidence interval."""

    mean: float
    low: float
    high: float
    n: int
    level: float = 0.95

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}] (n={self.n}, {self.level:.0%} CI)"


def wilson_interval(successes: int, n: int, level: float = 0.95) -> Estimate:
    """Wilson score interval of a pass rate."""
    if n <= 0:
        raise ValueError("wilson_interval: n must be positive")
    z, p = _z(level), successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return Estimate(p, max(0.0, center - half), min(1.0, center + half), n, level)


def mean_interval(values: Sequence[float], level: float = 0.95) -> Estimate:
    """Mean with a normal-approximation interval (t quantile for small n)."""
    x = np.asarray(values, np.float64)
    n = len(x)
    if n == 0:
        raise ValueError("mean_interval: no values")
    m = float(x.mean())
    if n == 1:
        return Estimate(m, -math.inf, math.inf, 1, level)
    se = float(x.std(ddof=1)) / math.sqrt(n)
    q = _t_quantile(n - 1, level)
    return Estimate(m, m - q * se, m + q * se, n, level)


def paired_difference(after: Sequence[float], before: Sequence[float],
                      level: float = 0.95) -> Estimate:
    """Mean of after - before on the same tasks, with its interval."""
    a, b = np.asarray(after, np.float64), np.asarray(before, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired_difference: {a.shape} vs {b.shape}; pair the same tasks")
    return mean_interval(a - b, level)


def _t_quantile(dof: int, level: float) -> float:
    """Two-sided Student-t quantile (table for small dof, normal beyond 30)."""
    table = {0.95: [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
                    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
                    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]}
    if level in table and dof <= 30:
        return table[level][dof - 1]
    return _z(level)
