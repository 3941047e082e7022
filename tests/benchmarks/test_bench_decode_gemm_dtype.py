"""bench_decode_gemm_dtype at toy size: the step's GEMM list and one timed row per
(batch, dtype), each library's total positive."""

from benchmarks.bench_decode_gemm_dtype import measure, step_gemms


def test_the_step_gemms_and_one_row_per_dtype():
    gemms = step_gemms(2)
    assert sum(g.count for g in gemms) == 4 * 7 + 1  # 7 per layer, then the head
    shapes = {(g.m, g.k, g.n, g.count) for g in gemms}
    assert (2, 256, 4096, 1) in shapes and (2, 256, 768, 8) in shapes  # head; gate + up
    for dtype in ("float32", "bfloat16"):
        row = measure(2, dtype, rounds=1, batch_ms=0.1, threads=1)
        assert row["dtype"] == dtype and row["xla_us"] > 0 and row["torch_us"] > 0
