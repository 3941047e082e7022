"""bench_compile_ahead at toy size, in this process: a warmup, then two updates of
the one geometry it compiled (`compiled_steps` 1), each part timed."""

from benchmarks.bench_compile_ahead import one


def test_a_warm_run_at_toy_size():
    got = one("toy", warm=True)
    assert got["compiled_steps"] == 1
    assert got["warmup_s"] > 0 and got["first_update_s"] > 0 and got["second_update_s"] > 0
    assert one("toy", warm=False)["warmup_s"] == 0.0
