"""bench_inflight_updates at toy size: both modes run the async loop side by side,
drain never mixes versions in an attempt nor recomputes, in_flight recomputes
exactly when it swaps under running rows, and the JSON carries the machine record."""

import json

from benchmarks.bench_inflight_updates import main

TOY = ["--hidden", "16", "--layers", "1", "--heads", "1", "--kv_heads", "1", "--vocab", "32",
       "--prompt_len", "3", "--short", "3", "--long", "12", "--long_every", "2",
       "--concurrency", "2", "--batch", "2", "--steps", "2", "--rounds", "1",
       "--prefill_chunk", "16", "--min_prefill_rows", "2", "--steps_per_sync", "4",
       "--warm_steps", "0", "--no_sampler_warmup"]


def test_both_modes_side_by_side(tmp_path):
    rows = main(TOY + ["--out", str(tmp_path / "b.json")])
    by = {r["mode"]: r for r in rows}
    assert set(by) == {"drain", "in_flight"} and all(r["steps"] == 2 for r in rows)
    assert by["drain"]["in_flight_swaps"] == 0 and by["drain"]["mixed_attempts"] == 0
    assert by["drain"]["recomputed_tokens"] == 0
    # Whether a publish finds rows running is timing: only what always holds.
    f = by["in_flight"]
    assert f["in_flight_swaps"] <= f["weight_swaps"] <= 2
    assert (f["recomputed_tokens"] > 0) == (f["in_flight_swaps"] > 0)
    assert all(r["steps_per_s"] > 0 and r["short_done"] > 0 for r in rows)
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["machine"]["cpus"] and set(saved["summary"]) == {"drain", "in_flight"}
