"""benchmarks/bench_lora at toy size (the tiny Qwen3 preset): the LoRA step and the
adapter publish each run in their own child and report peak RSS, times, and what the
optimizer trains (the adapters alone for LoRA)."""

from __future__ import annotations

import json

from benchmarks import bench_lora


def test_tiny_lora_step_and_publish_run_in_children(tmp_path):
    out = tmp_path / "lora.json"
    rows = bench_lora.main(["--variants", "tiny", "--tokens", "64", "--chunk", "16",
                            "--cases", "jax_lora,publish", "--lock", "",
                            "--ckpt_dir", str(tmp_path / "ckpts"), "--out", str(out)])
    assert [r["case"] for r in rows] == ["jax_lora", "publish"]
    for r in rows:
        assert "error" not in r, r
        assert r["peak_rss_gb"] > 0.05
    lora, publish = rows
    assert lora["rss_timeline"][0][0] == "start"
    # publish: a learner process publishes, then a sampler process loads.
    assert [p for p, _, _ in publish["learner_timeline"]] == [
        "start", "learner loaded", "publish lora", "publish full"]
    assert [p for p, _, _ in publish["sampler_timeline"]] == [
        "start", "sampler loaded", "load_published lora", "load_published full"]
    assert publish["peak_rss_gb"] == max(publish["learner_peak_rss_gb"],
                                         publish["sampler_peak_rss_gb"])
    assert lora["first_step_s"] > 0 and lora["step_s"] > 0 and lora["loss"] == lora["loss"]
    # The peak splits into the load phase's and the steps' own (VmHWM reset between).
    assert 0 < lora["step_peak_rss_gb"] <= lora["peak_rss_gb"] + 1e-6
    assert lora["peak_rss_gb"] == max(lora["load_peak_gb"], lora["step_peak_rss_gb"])
    # The optimizer holds the adapters only: rank 16 on all seven projections of 3 layers
    # (d=32, q 64, kv 32, mlp 64), AdamW's mu + nu of them (+ its step count).
    d, q, kv, f, r = 32, 64, 32, 64, 16
    per_layer = r * ((d + q) * 2 + (d + kv) * 2 + (d + f) * 3)
    assert lora["trainable_params"] == 3 * per_layer
    assert lora["opt_state_values"] - 2 * lora["trainable_params"] < 8
    assert lora["frozen_params"] == lora["params"]  # the whole base rides in `rest`
    assert lora["lora"]["targets"] == ["q", "k", "v", "o", "gate", "up", "down"]
    # The publish: the adapters alone are smaller than the full model, and the sampler
    # side's LoRA model loaded exactly what the learner published.
    assert publish["adapter_roundtrip_ok"]
    assert 0 < publish["lora_bytes"] < publish["full_bytes"]
    assert publish["trainable_params"] == lora["trainable_params"]
    assert publish["lora_publish_to_serve_s"] > 0 and publish["full_publish_to_serve_s"] > 0
    assert json.loads(out.read_text())["rows"][1]["case"] == "publish"


def test_need_and_fit_arithmetic():
    shape = bench_lora._shape("default")
    # Qwen3-0.6B: 596M parameters (tied embedding counted once); 1.7B: 1.72B.
    assert abs(bench_lora.param_count(shape) - 596e6) < 2e6
    assert abs(bench_lora.param_count(bench_lora._shape("1.7b")) - 1.72e9) < 0.01e9
    # The 1.7B full fine-tune's fp32 state alone is 27.5 GB: more than the box has.
    assert bench_lora.need_gb("jax_full", bench_lora._shape("1.7b"), 1024) > 27.5
    assert bench_lora.need_gb("jax_lora_bf16", shape, 1024) < bench_lora.need_gb(
        "jax_lora", shape, 1024) < bench_lora.need_gb("jax_full", shape, 1024)
