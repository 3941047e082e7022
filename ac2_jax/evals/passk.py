"""pass@k and pass^k from n attempts per task (unbiased estimators).

With n attempts of a task of which c passed:

    pass@k = 1 - C(n - c, k) / C(n, k)   P(at least one of k fresh attempts passes)
    pass^k = C(c, k) / C(n, k)           P(all k fresh attempts pass)

both unbiased for k <= n (Chen et al. 2021 for pass@k; pass^k as in
tau-bench). They are computed per task in exact integer arithmetic, then
averaged over tasks with a t interval over tasks (`Estimate.method` "t").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from fractions import Fraction

from ac2_jax.evals.stats import Estimate, mean_interval


def _check(n: int, c: int, k: int, who: str) -> None:
    for name, v in (("n", n), ("c", c), ("k", k)):
        if isinstance(v, bool) or int(v) != v:
            raise ValueError(f"{who}: {name} must be an int, got {v!r}")
    if not 0 <= c <= n:
        raise ValueError(f"{who}: need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(
            f"{who}: need 1 <= k <= n (k attempts out of the n made), got k={k}, n={n}"
        )


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task: n attempts, c passed, 1 <= k <= n."""
    _check(n, c, k, "pass_at_k")
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Unbiased pass^k of one task (all k attempts pass): n attempts, c passed."""
    _check(n, c, k, "pass_hat_k")
    return float(Fraction(math.comb(c, k), math.comb(n, k)))


def pass_k_values(max_k: int) -> list[int]:
    """The k reported for `max_k` attempts per task: powers of 2 below it, and max_k."""
    if max_k < 1:
        raise ValueError(f"pass_k_values: max_k must be >= 1, got {max_k}")
    return sorted({2**i for i in range(max_k.bit_length()) if 2**i <= max_k} | {max_k})


def _interval(counts: Sequence[tuple[int, int]], k: int, level: float, fn, who: str) -> Estimate:
    if len(counts) == 0:
        raise ValueError(f"{who}: no tasks")
    short = [i for i, (n, _) in enumerate(counts) if n < k]
    if short:
        raise ValueError(
            f"{who}: tasks {short[:5]} have fewer than k={k} attempts; "
            "drop them (and count them) or lower k"
        )
    e = mean_interval([fn(n, c, k) for n, c in counts], level)
    return dataclasses.replace(e, low=max(0.0, e.low), high=min(1.0, e.high))


def pass_at_k_interval(counts: Sequence[tuple[int, int]], k: int, level: float = 0.95) -> Estimate:
    """Mean over tasks of pass@k, with a t interval over tasks (clipped to [0, 1]).

    counts: (n attempts, c passed) per task, every n >= k.
    """
    return _interval(counts, k, level, pass_at_k, "pass_at_k_interval")


def pass_hat_k_interval(counts: Sequence[tuple[int, int]], k: int, level: float = 0.95) -> Estimate:
    """Mean over tasks of pass^k, with a t interval over tasks (clipped to [0, 1])."""
    return _interval(counts, k, level, pass_hat_k, "pass_hat_k_interval")
