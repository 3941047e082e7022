"""benchmarks/bench_decoder at toy size: the scanned decoder compiles and steps; the
block-sparse kernel's own tile count is the dense count's 1/segments on a
row of equal segments, and its output equals the dense kernel's (fp32, 1e-5); a tiny
preset's random checkpoint matches transformers (fp32, 1e-4)."""

from __future__ import annotations

import json

from benchmarks import bench_decoder


def test_toy_run_reports_compiles_and_tile_counts(tmp_path):
    out = tmp_path / "decoder.json"
    res = bench_decoder.main([
        "--layers=1", "--hidden=16", "--compile_seq_len=16", "--seq_len=64", "--segments=4",
        "--block=16", "--heads", "2", "1", "8", "--repeats=1", "--remats", "none",
        "--layouts", "scan", "--parity", "tiny",
        "--rows", "segmented", "--out", str(out)])
    assert [(r["scan"], r["remat"]) for r in res["compile"]] == [(True, "none")]
    for r in res["compile"]:
        assert r["compile_s"] > 0 and r["hlo_chars"] > 0 and r["step_s"] > 0
    (row,) = res["attention"]
    assert row["row"] == "flat_4seg" and row["tokens"] == 64
    assert row["sparse_tiles"] == 4 and row["dense_tiles"] == 16  # the 4 diagonal tiles
    assert row["tile_fraction"] == 0.25 and row["max_abs_diff"] <= 1e-5
    assert row["sparse_fwd_bwd_s"] > 0 and row["dense_fwd_bwd_s"] > 0
    parity = res["parity"]  # the tiny preset's random checkpoint vs transformers
    assert parity["scan"] and parity["layers"] == 3 and parity["max_abs_diff"] <= 1e-4
    with open(out) as f:
        assert json.load(f)["attention"] == json.loads(json.dumps(res["attention"]))
