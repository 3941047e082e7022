"""benchmarks/family_memory at toy size: per family (Gemma 3, Qwen3-MoE) a random
checkpoint from transformers' config class and one RL step with every default, each in
its own child under the flock, reporting its peak RSS."""

from __future__ import annotations

import json

from benchmarks import family_memory


def test_toy_shapes_run_one_rl_step_each_in_a_child(tmp_path):
    out = tmp_path / "fm.json"
    rows = family_memory.main([
        "--shapes", "gemma3-tiny,qwen3-moe-tiny:1:4", "--tokens", "64", "--steps", "1",
        "--lock", str(tmp_path / "lock"), "--wait_s", "60", "--workdir", str(tmp_path),
        "--out", str(out),
    ])  # fmt: skip
    assert [r["shape"] for r in rows] == ["gemma3-tiny", "qwen3-moe-tiny:1:4"]
    for r in rows:
        assert "error" not in r, r
        assert r["peak_rss_gb"] > 0.05 and r["first_step_s"] > 0 and r["loss"] == r["loss"]
        assert 0 < r["params"] < 100_000 and r["need_gb"] >= 1
        assert r["plan"][0].startswith("memory plan for a")  # the defaults were planned
    # the cut MoE shape: 1 layer of 4 experts (top 2), fewer params than 2 layers of 8
    assert rows[1]["params"] < family_memory.count_params("qwen3-moe-tiny")
    assert family_memory.shape_kwargs("gemma3-1b:3")[1]["layer_types"] == [
        family_memory.S,
        family_memory.S,
        family_memory.S,
    ]
    assert json.loads(out.read_text())["rows"][0]["shape"] == "gemma3-tiny"
    assert list(tmp_path.glob("tmp*/*")) == []  # checkpoints removed
