"""benchmarks/bench_load_published.py at toy size: a publish child and a load child run,
and the load's figures come back (a load reads something: the peak is above the RSS
before it)."""

from benchmarks import bench_load_published


def test_toy_publish_then_load_in_children(tmp_path):
    row = bench_load_published.main(["--hidden", "128", "--ffn", "256", "--layers", "2",
                                     "--vocab", "512", "--out", str(tmp_path / "r.json")])
    assert row["params_gb"] > 0 and row["load_s"] > 0
    assert row["peak_gb"] >= row["rss_before_gb"] > 0
    assert (tmp_path / "r.json").exists()
