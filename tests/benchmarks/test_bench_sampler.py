"""bench_sampler at toy size, against transformers' `generate` on the same weights:
greedy rows agree token for token with it, and the sampled mode (the RL
collector's case) runs both samplers for exactly the requested tokens."""

import json

from benchmarks.bench_sampler import main

TOY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--kv_heads", "1", "--vocab", "64",
       "--prompt_len", "4", "--lengths", "6", "--batches", "1,2", "--repeats", "1"]


def test_greedy_rows_agree_with_generate(tmp_path):
    rows = main(TOY + ["--out", str(tmp_path / "s.json")])
    assert [(r["batch"], r["new_tokens"]) for r in rows] == [(1, 6), (2, 6)]
    for r in rows:
        assert r["agree"] == 6  # fp32, 6 greedy tokens: no near-tie expected at this size
        assert r["jax_tok_s"] > 0 and r["hf_tok_s"] > 0
        assert abs(r["speedup"] - r["hf_s"] / r["jax_s"]) < 1e-9
    saved = json.loads((tmp_path / "s.json").read_text())
    assert saved["config"]["temperature"] == 0.0 and len(saved["rows"]) == 2


def test_sampled_mode_runs_both_sides(tmp_path):
    rows = main(TOY + ["--temperature", "1.0", "--batches", "2"])
    (r,) = rows
    assert r["agree"] is None and r["hf_tok_s"] > 0 and r["jax_tok_s"] > 0
