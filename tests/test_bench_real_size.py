"""benchmarks/bench_real_size at toy size (the tiny Qwen3 preset): every case runs in
its own child process and reports its own peak RSS and step times."""

from __future__ import annotations

import json

from benchmarks import bench_real_size


def test_tiny_preset_runs_every_case_in_a_child(tmp_path):
    out = tmp_path / "real.json"
    rows = bench_real_size.main(["--variant", "tiny", "--tokens", "64", "--chunk", "16",
                                 "--cases", "jax_rl,torch", "--out", str(out)])
    assert [r["case"] for r in rows] == ["jax_rl", "torch"]
    for r in rows:
        assert "error" not in r, r
        assert r["peak_rss_gb"] > 0.05 and r["step_s"] > 0 and r["loss"] == r["loss"]  # not NaN
    assert rows[0]["config"]["scan_layers"] == "True"
    assert json.loads(out.read_text())["rows"][0]["case"] == "jax_rl"
