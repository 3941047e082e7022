"""benchmarks/cpu_gemm (an OpenBLAS GEMM as an XLA FFI custom call) and its benchmark:
the products equal XLA's in fp32 for every transpose, the custom VJP gives jax.grad's
gradients, the benchmark's pipeline runs at a tiny size with its patched step computing
the same loss as ours."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import cpu_gemm


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed: the custom call cannot be built here")
    return cpu_gemm.build(str(tmp_path_factory.mktemp("so")))


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_gemm_equals_xla_for_every_transpose(built, trans_a, trans_b):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((37, 19), dtype=np.float32)
    b = rng.standard_normal((19, 23), dtype=np.float32)
    A, B = (a.T if trans_a else a), (b.T if trans_b else b)
    got = jax.jit(lambda x, y: cpu_gemm.gemm(x, y, trans_a, trans_b))(A, B)
    np.testing.assert_allclose(np.asarray(got), a @ b, rtol=1e-5, atol=1e-5)  # fp32


def test_matmul_gradients_equal_autodiff_of_the_plain_product(built):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 5, 19), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((19, 23), dtype=np.float32))
    ours = jax.jit(jax.grad(lambda x, w: jnp.sum(jnp.tanh(cpu_gemm.matmul(x, w)) ** 2),
                            (0, 1)))(x, w)
    ref = jax.grad(lambda x, w: jnp.sum(jnp.tanh(x @ w) ** 2), (0, 1))(x, w)
    for got, want in zip(ours, ref, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_gemm_refuses_what_it_cannot_compute(built):
    with pytest.raises(ValueError, match="2-D float32"):
        cpu_gemm.gemm(jnp.ones((2, 3, 4)), jnp.ones((4, 2)))
    with pytest.raises(ValueError, match="inner dimensions differ"):
        cpu_gemm.gemm(jnp.ones((2, 3)), jnp.ones((4, 2)))


def test_benchmark_runs_at_tiny_size_and_its_step_matches_ours(built, tmp_path):
    from benchmarks import bench_cpu_gemm

    out = tmp_path / "r.json"
    (r,) = bench_cpu_gemm.main(["--sizes", "tiny", "--rounds", "1", "--batch_ms", "1",
                                "--out", str(out)])
    assert all(g["blas_max_abs_diff"] < 1e-3 for g in r["gemms"])
    assert r["first_loss_blas"] == pytest.approx(r["first_loss_xla"], rel=1e-5)
    assert r["blas_step_min_s"] > 0 and out.exists()
