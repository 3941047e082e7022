"""bench_shared_prompt at toy size: both modes run the same groups side by side; sharing
computes the group's prompt once (the others copy it), the per-attempt sampler computes
it per attempt, both sample the same tokens (vocabulary 64: no rounding flip), and the JSON carries the machine record."""

import json

from benchmarks.bench_shared_prompt import main

TOY = ["--size", "toy", "--vocab", "64", "--attempts", "3", "--prompt_len", "40",
       "--max_tokens", "4", "--rounds", "1", "--prefill_chunk", "16"]


def test_both_modes_side_by_side(tmp_path):
    rows = main(TOY + ["--out", str(tmp_path / "b.json")])
    by = {(r["attempts"], r["mode"]): r for r in rows}
    for n in (3,):
        shared, alone = by[n, "shared"], by[n, "per_attempt"]
        assert (shared["prefill_tokens"], shared["shared_tokens"]) == (39, (n - 1) * 39)
        assert (alone["prefill_tokens"], alone["shared_tokens"]) == (n * 39, 0)
        assert shared["rollout_s"] > 0 and alone["rollout_s"] > 0
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["machine"]["cpus"] and (saved["diverged"], saved["compared"]) == (0, 6)  # 3 attempts x 2 rounds (warm-up too)
    assert saved["max_logprob_diff"] < 1e-5 and len(saved["loadavg"]) == 2
