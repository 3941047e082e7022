"""benchmarks/bench_moe at toy size: every case runs and reports its time against the
dense model of the same active parameters; the capacity case counts its drops; the
replay figures are finite and replay is no further from the sampler than recompute."""

from __future__ import annotations

import json

from benchmarks import bench_moe


def test_toy_moe_vs_dense(tmp_path):
    out = tmp_path / "moe.json"
    rows = bench_moe.main(["--tokens", "48", "--hidden", "32", "--heads", "4", "--layers", "1",
                           "--experts", "4", "--moe_ffn", "8", "--vocab", "128",
                           "--capacity", "0.5", "--repeats", "1", "--out", str(out)])
    by = {r["case"]: r for r in rows}
    assert list(by) == list(bench_moe.CASES)
    dense = by["dense"]
    assert dense["x_dense"] == 1.0 and dense["params"] == dense["active_params"]
    for case in ("moe_ragged", "moe_capacity", "moe_all_experts"):
        r = by[case]
        assert r["fwd_bwd_s"] > 0 and r["x_dense"] > 0
        # same active parameters as the dense model, up to the router (D x E per layer)
        assert r["active_params"] - dense["params"] == 32 * 4
        assert r["params"] > r["active_params"]
    assert by["moe_ragged"]["dropped"] == 0 and by["moe_capacity"]["dropped"] > 0
    replay = by["replay"]
    assert 0 <= replay["tokens_flipped"] <= 1
    assert replay["replay_max"] <= replay["recompute_max"] + 1e-6
    saved = json.loads(out.read_text())
    assert saved["machine"]["cpu_model"] and len(saved["rows"]) == len(rows)
