"""Confidence intervals for eval results (quantiles from scipy.stats).

- `wilson_interval`: a pass rate over independent attempts (Wilson score,
  well-behaved near 0 and 1).
- `mean_interval`: a mean with a Student-t interval (n - 1 dof).
- `bootstrap_interval`: a mean with a seeded percentile bootstrap.
- `clustered_interval`: a mean over tasks that each have several attempts:
  the mean of the per-task means, with a t interval over tasks (G - 1 dof).
  Attempts of one task are correlated, so they are not counted as
  independent samples; every task weighs the same.
- `paired_difference`: after - before on the same tasks: a paired t interval
  over the task-level differences.

Every interval is two-sided at any `level` in (0, 1); `Estimate.method` names
how it was made.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import scipy.stats


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A mean with its confidence interval; `method` says which interval
    ("wilson", "t", "bootstrap", "clustered-t", "paired-t", ...)."""

    mean: float
    low: float
    high: float
    n: int
    level: float
    method: str

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-able; an unbounded end (n = 1) is None."""

        def num(x):
            return float(x) if math.isfinite(x) else None

        return {
            "mean": num(self.mean),
            "low": num(self.low),
            "high": num(self.high),
            "n": self.n,
            "level": self.level,
            "method": self.method,
        }

    def __str__(self) -> str:
        return (
            f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}] "
            f"(n={self.n}, {self.level:.0%} {self.method})"
        )


def _check_level(level: float, who: str) -> float:
    if not 0.0 < float(level) < 1.0:
        raise ValueError(f"{who}: level must be in (0, 1), e.g. 0.95; got {level}")
    return float(level)


def _values(values: Sequence[float] | np.ndarray, who: str) -> np.ndarray:
    x = np.asarray(values, np.float64)
    if x.ndim != 1 or len(x) == 0:
        raise ValueError(f"{who}: need a non-empty 1-D sequence of numbers, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        bad = np.flatnonzero(~np.isfinite(x))[:5].tolist()
        raise ValueError(f"{who}: values must be finite; NaN or inf at positions {bad}")
    return x


def z_quantile(level: float) -> float:
    """Two-sided normal quantile: z with P(|Z| <= z) = level."""
    return float(scipy.stats.norm.ppf(0.5 + _check_level(level, "z_quantile") / 2))


def t_quantile(dof: int, level: float) -> float:
    """Two-sided Student-t quantile with `dof` degrees of freedom."""
    if dof < 1:
        raise ValueError(f"t_quantile: dof must be >= 1, got {dof}")
    return float(scipy.stats.t.ppf(0.5 + _check_level(level, "t_quantile") / 2, dof))


def wilson_interval(successes: int, n: int, level: float = 0.95) -> Estimate:
    """Wilson score interval of a pass rate: `successes` of `n` independent attempts."""
    if n <= 0:
        raise ValueError("wilson_interval: n must be positive")
    if not 0 <= successes <= n:
        raise ValueError(f"wilson_interval: successes must be in [0, n={n}], got {successes}")
    z, p = z_quantile(level), successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return Estimate(p, max(0.0, center - half), min(1.0, center + half), n, level, "wilson")


def mean_interval(values: Sequence[float] | np.ndarray, level: float = 0.95) -> Estimate:
    """Mean with a Student-t interval (n - 1 dof); n = 1 gives (-inf, inf)."""
    x = _values(values, "mean_interval")
    _check_level(level, "mean_interval")
    n, m = len(x), float(x.mean())
    if n == 1:
        return Estimate(m, -math.inf, math.inf, 1, level, "t")
    half = t_quantile(n - 1, level) * float(x.std(ddof=1)) / math.sqrt(n)
    return Estimate(m, m - half, m + half, n, level, "t")


def bootstrap_interval(
    values: Sequence[float], level: float = 0.95, *, seed: int = 0, n_resamples: int = 9999
) -> Estimate:
    """Mean with a percentile bootstrap interval (scipy.stats.bootstrap, seeded)."""
    x = _values(values, "bootstrap_interval")
    _check_level(level, "bootstrap_interval")
    if len(x) < 2:
        raise ValueError("bootstrap_interval: need at least 2 values to resample")
    res = scipy.stats.bootstrap(
        (x,),
        np.mean,
        confidence_level=level,
        method="percentile",
        n_resamples=n_resamples,
        rng=np.random.default_rng(seed),
    )
    ci = res.confidence_interval
    return Estimate(float(x.mean()), float(ci.low), float(ci.high), len(x), level, "bootstrap")


def clustered_interval(
    groups: Sequence[Sequence[float]],
    level: float = 0.95,
    *,
    bounds: tuple[float, float] | None = None,
) -> Estimate:
    """Mean of per-group (per-task) means, t interval over groups (G - 1 dof).

    groups: one sequence of attempt values per task (sizes may differ, none
    empty). bounds: clip the interval to (lo, hi), e.g. (0, 1) for rates.
    n of the result is the number of groups. Tasks whose means are all equal
    give a zero-width interval (the t interval sees no spread).
    """
    if len(groups) == 0:
        raise ValueError("clustered_interval: no groups")
    means = [
        float(_values(g, f"clustered_interval (group {i})").mean()) for i, g in enumerate(groups)
    ]
    e = mean_interval(means, level)
    low, high = e.low, e.high
    if bounds is not None:
        low, high = max(bounds[0], low), min(bounds[1], high)
    return Estimate(e.mean, low, high, e.n, level, "clustered-t")


def paired_difference(
    after: Sequence[float], before: Sequence[float], level: float = 0.95
) -> Estimate:
    """Mean of after - before on the same tasks (one value per task each), with a
    paired t interval over the differences."""
    a, b = np.asarray(after, np.float64), np.asarray(before, np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired_difference: {a.shape} vs {b.shape}; pair the same tasks")
    e = mean_interval(a - b, level)
    return dataclasses.replace(e, method="paired-t")
