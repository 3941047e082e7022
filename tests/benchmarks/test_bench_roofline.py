"""bench_roofline at toy size: every library's GEMM computes the product it times,
and the ceiling is the best row; bench_train_step's goal rows compare against it."""

import numpy as np
import pytest

from benchmarks.bench_roofline import LIBRARIES, _operands, gemm_call, gemm_ceiling, roofline
from benchmarks.bench_train_step import goal_rows


@pytest.mark.parametrize("library", LIBRARIES)
def test_each_library_multiplies(library):
    if library == "torch":
        pytest.importorskip("torch")
    a, b = _operands(64)
    np.testing.assert_allclose(gemm_call(library, a, b)(), a.astype(np.float64) @ b,
                               rtol=1e-4, atol=1e-3)


def test_the_ceiling_is_the_best_rate_and_the_goal_is_judged_against_it():
    pytest.importorskip("torch")
    c = gemm_ceiling([32, 64], min_seconds=0.01)
    assert [(r["library"], r["n"]) for r in c["rows"]] == [
        (lib, n) for lib in LIBRARIES for n in (32, 64)]
    best = max(c["rows"], key=lambda r: r["gflops"])
    assert c["ceiling_gflops"] == best["gflops"] > 0
    assert c["ceiling_by"] == (best["library"], best["n"])
    rows = [{"size": "s", "impl": "ac2_jax (jit)", "gflops": 50.0},
            {"size": "s", "impl": "transformers+torch", "gflops": 60.0},
            {"size": "m", "impl": "transformers+torch", "gflops": 80.0}]
    g = goal_rows(rows, ceiling_gflops=100.0)
    assert [(r["size"], r["goal_gflops"], r["reachable_at_equal_flops"]) for r in g] == [
        ("s", 90.0, True), ("m", 120.0, False)]
    with pytest.raises(ValueError, match="library must be one of"):
        gemm_call("blas", *_operands(4))


def test_the_roofline_is_xla_alone():
    r = roofline([32, 64], min_seconds=0.01)
    assert [(x["library"], x["n"]) for x in r["rows"]] == [("xla", 32), ("xla", 64)]
    assert r["peak_gflops"] == max(x["gflops"] for x in r["rows"])
