"""benchmarks/bench_real_size at toy size (the tiny Qwen3 preset): every case runs in
its own child process and reports its own peak RSS and step times."""

from __future__ import annotations

import json

from benchmarks import bench_real_size


def test_tiny_preset_runs_every_case_in_a_child(tmp_path):
    out = tmp_path / "real.json"
    rows = bench_real_size.main(["--variant", "tiny", "--tokens", "64", "--chunk", "16",
                                 "--cases", "jax_rl,torch,jax_decode,jax_sched,jax_default",
                                 "--decode_tokens", "4",
                                 "--out", str(out)])
    assert [r["case"] for r in rows] == ["jax_rl", "torch", "jax_decode", "jax_sched",
                                         "jax_default"]
    for r in rows:
        assert "error" not in r, r
        assert r["peak_rss_gb"] > 0.05 and r["step_s"] > 0
        # The timeline's last high-water mark is the peak the row reports (same process).
        phases = [p for p, _, _ in r["rss_timeline"]]
        assert phases[0] == "start" and r["rss_timeline"][-1][2] <= r["peak_rss_gb"] + 1e-3
    rl, torch_row, decode, sched, default = rows
    assert rl["loss"] == rl["loss"] and torch_row["loss"] == torch_row["loss"]  # not NaN
    assert rl["config"]["scan_layers"] == "True" and rl["memory_scheduler"]
    assert [p for p, _, _ in rl["rss_timeline"]] == [
        "start", "abstract compile (memory_analysis)", "load checkpoint", "create_train_state",
        "place", "step 1", "step 2"]
    # XLA's accounting: the whole donated state is aliased to the output (all of it but
    # the metric scalars).
    xla = rl["xla_bytes"]
    assert xla["alias"] > 100_000 and 0 < xla["output"] - xla["alias"] < 1_000, xla
    assert sched["memory_over_default"] > 0 and sched["default_scheduler_step_s"] > 0
    assert decode["batch"] == 8 and decode["output_tokens"] == 32 and decode["tokens_per_s"] > 0
    # Every default: the tiny model keeps the fast choices, and the plan was logged.
    assert default["config"]["scan_layers"] == "False" and default["loss"] == default["loss"]
    assert any(line.startswith("train step memory plan") for line in default["plan"])
    assert json.loads(out.read_text())["rows"][0]["case"] == "jax_rl"
