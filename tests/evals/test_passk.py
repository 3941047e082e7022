"""pass@k and pass^k: hand-worked cases and brute force over subsets."""

import itertools
import math

import pytest

from ac2_jax.evals import (
    mean_interval,
    pass_at_k,
    pass_at_k_interval,
    pass_hat_k,
    pass_hat_k_interval,
    pass_k_values,
)


def test_hand_worked_cases():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2) = 0.7
    assert pass_hat_k(5, 2, 2) == pytest.approx(1 / 10)     # C(2,2)/C(5,2)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3) == pass_hat_k(10, 3, 1)
    assert pass_at_k(4, 0, 2) == 0.0 and pass_hat_k(4, 4, 3) == 1.0
    assert pass_at_k(4, 3, 2) == 1.0  # fewer than k failures: every k-subset has a pass
    assert pass_hat_k(4, 1, 2) == 0.0


@pytest.mark.parametrize("n", range(1, 8))
def test_equal_to_enumeration_over_all_k_subsets(n):
    for c in range(n + 1):
        outcomes = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            assert len(subsets) == math.comb(n, k)
            any_pass = sum(max(s) for s in subsets) / len(subsets)
            all_pass = sum(min(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(any_pass, abs=1e-15)
            assert pass_hat_k(n, c, k) == pytest.approx(all_pass, abs=1e-15)


def test_large_n_stays_exact():
    # C(200, 100) overflows float64's exact range; the integer arithmetic does not care.
    assert pass_at_k(200, 1, 100) == pytest.approx(0.5, abs=1e-15)
    assert pass_hat_k(200, 199, 100) == pytest.approx(0.5, abs=1e-15)


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="c <= n"):
        pass_hat_k(3, 4, 1)
    with pytest.raises(ValueError, match="must be an int"):
        pass_at_k(3.5, 1, 1)


def test_k_values_are_powers_of_two_and_k():
    assert pass_k_values(1) == [1]
    assert pass_k_values(2) == [1, 2]
    assert pass_k_values(5) == [1, 2, 4, 5]
    assert pass_k_values(8) == [1, 2, 4, 8]
    with pytest.raises(ValueError):
        pass_k_values(0)


def test_interval_is_a_t_interval_over_per_task_values():
    counts = [(4, 0), (4, 1), (4, 2), (4, 4), (4, 3), (4, 1)]
    for k in (1, 2, 4):
        e = pass_at_k_interval(counts, k, 0.9)
        ref = mean_interval([pass_at_k(n, c, k) for n, c in counts], 0.9)
        assert e.n == 6 and e.mean == pytest.approx(ref.mean)
        assert e.low == pytest.approx(max(0.0, ref.low))
        assert e.high == pytest.approx(min(1.0, ref.high))
        h = pass_hat_k_interval(counts, k, 0.9)
        assert h.mean == pytest.approx(sum(pass_hat_k(n, c, k) for n, c in counts) / 6)
        assert h.mean <= e.mean
    with pytest.raises(ValueError, match="fewer than k=3"):
        pass_at_k_interval([(4, 1), (2, 1)], 3)
