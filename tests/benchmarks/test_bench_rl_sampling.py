"""bench_rl_sampling at toy size (the quick variant: 3 SFT steps, one RL step of
2 x 2 attempts): one row per RL step whose idle time is the sampling wall time
less the sampler's own decode and prefill time; warmed up, nothing compiles."""

import pytest

from benchmarks.bench_rl_sampling import run


def test_one_rl_step_of_the_quick_variant(tmp_path):
    (row,) = run(str(tmp_path / "run"), steps=1, warmup=True, variant="quick")
    assert row["step"] == 1 and row["new_shapes"] == 0
    assert row["decode_steps"] > 0 and row["output_tokens"] > 0 and row["mean_active_rows"] > 0
    assert row["idle_s"] == pytest.approx(row["sampling_s"] - row["decode_s"] - row["prefill_s"])
    assert (tmp_path / "run" / "sft_params").exists()  # the warm start is kept for reruns
