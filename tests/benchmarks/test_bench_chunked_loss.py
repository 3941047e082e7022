"""benchmarks/bench_chunked_loss at toy size: both variants run, report the same loss,
and the chunked one compiles to less temp memory than one fp32 [L, V] logits buffer
(the dense one to more); --max_gb skips are counted, never silent."""

from __future__ import annotations

import json

import numpy as np

from benchmarks import bench_chunked_loss


def test_toy_run_reports_memory_time_and_equal_losses(tmp_path):
    out = tmp_path / "bench.json"
    res = bench_chunked_loss.main(["--vocab=2048", "--dim=16", "--lengths=256,512",
                                   "--chunks=64", "--repeats=1", "--out", str(out)])
    rows = res["rows"]
    assert [(r["L"], r["impl"]) for r in rows] == [
        (256, "dense"), (256, "chunked(64)"), (512, "dense"), (512, "chunked(64)")]
    assert res["skipped"] == 0
    for dense, chunked in (rows[0:2], rows[2:4]):
        full = dense["full_logits_GB"]
        assert dense["temp_GB"] >= full > chunked["temp_GB"]
        assert dense["step_s"] > 0 and chunked["step_s"] > 0
        np.testing.assert_allclose(chunked["loss"], dense["loss"], rtol=1e-5)
    with open(out) as f:
        assert json.load(f)["rows"] == json.loads(json.dumps(rows))
    tight = bench_chunked_loss.main(["--vocab=2048", "--dim=16", "--lengths=256", "--chunks=64",
                                     "--repeats=1", "--max_gb=0"])
    assert tight["skipped"] == 2 and all("not run" in r["note"] for r in tight["rows"])
