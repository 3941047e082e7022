"""bench_matmul_ceiling at toy size: its GEMM list is the train step's matmul work
(FLOPs equal bench_train_step's count), each GEMM computes the product it names
(vs numpy, fp32), and a tiny run times both libraries and both whole steps."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import bench_matmul_ceiling as bmc
from benchmarks.bench_train_step import SIZES, config_of, step_flops


@pytest.mark.parametrize("size", ["tiny", "small", "medium"])
def test_gemm_list_has_the_step_flops(size):
    c, (_, rows, seq_len) = config_of(size), SIZES[size]
    total = sum(g.flops * g.count for g in bmc.step_gemms(size))
    assert total == pytest.approx(step_flops(c, rows, seq_len), rel=1e-12)


def test_each_gemm_is_the_product_it_names():
    rng = np.random.default_rng(0)
    for g in bmc.step_gemms("tiny"):
        a, b = (rng.standard_normal(s, dtype=np.float32) for s in g.shapes())
        a2 = np.swapaxes(a, -1, -2) if g.lhs_t else a  # [.., m, k]
        b2 = np.swapaxes(b, -1, -2) if g.rhs_t else b  # [.., k, n]
        want = np.matmul(a2.astype(np.float64), b2.astype(np.float64))
        got = np.asarray(bmc._jax_fn(g)(a, b))
        assert got.shape == ((g.batch,) if g.batch else ()) + (g.m, g.n), g
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3 * np.sqrt(g.k), err_msg=g.name)
        import torch
        tgot = bmc._torch_fn(g)(torch.from_numpy(a), torch.from_numpy(b)).numpy()
        np.testing.assert_allclose(tgot, want, rtol=1e-4, atol=1e-3 * np.sqrt(g.k),
                                   err_msg=g.name)


def test_tiny_run_times_both_sides(tmp_path):
    out = tmp_path / "c.json"
    (r,) = bmc.main(["--sizes", "tiny", "--rounds", "1", "--batch_ms", "1", "--out", str(out)])
    assert len(r["gemms"]) == len(bmc.step_gemms("tiny"))
    for side in ("xla", "torch"):
        want = sum(g[f"{side}_min_ms"] * g["count"] for g in r["gemms"]) / 1e3
        assert r[f"{side}_matmuls_min_s"] == pytest.approx(want)
        assert r[f"{side}_step_min_s"] > 0
    assert r["reachable_1p5x"] == (r["xla_matmuls_min_s"] <= r["torch_step_min_s"] / 1.5)
    assert max(g["max_abs_diff"] for g in r["gemms"]) < 1e-3
    assert json.loads(out.read_text())["rows"][0]["size"] == "tiny"
