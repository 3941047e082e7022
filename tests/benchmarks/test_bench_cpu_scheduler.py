"""bench_cpu_scheduler at toy size: both schedulers compile and run the same step
(same loss, fp32, 1e-6: the scheduler orders work, it does not change the maths)."""

import json

import numpy as np

from benchmarks.bench_cpu_scheduler import main


def test_both_schedulers_run_the_same_step(tmp_path):
    (row,) = main(["--sizes", "tiny", "--rounds", "1", "--out", str(tmp_path / "r.json")])
    np.testing.assert_allclose(row["loss_memory_optimized"], row["loss_default"], rtol=1e-6)
    assert row["memory_optimized_s"] > 0 and row["default_s"] > 0
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == [row]
