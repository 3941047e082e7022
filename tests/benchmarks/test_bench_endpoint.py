"""benchmarks/bench_endpoint --mode=process at toy size: the endpoint and the
load harness each in their own process, 16 concurrent rollouts x 4 turns:
nothing lost, nothing cross-wired, the store holds every finished trace."""

from __future__ import annotations

import json

from benchmarks import bench_endpoint


def test_process_mode_16_rollouts_x_4_turns_nothing_lost_or_cross_wired(tmp_path):
    out = tmp_path / "bench.json"
    res = bench_endpoint.main([
        "--mode=process", "--clients=16", "--rollouts_per_client=1", "--turns=4",
        "--max_tokens=2", "--max_context=256", "--warmup_runs=0", "--memory_rollouts=8",
        "--memory_turns=1", "--rss_every=4", "--out", str(out)])
    load, mem = res["rows"]
    assert (load["run"], load["clients"], load["rollouts"], load["turns"]) == ("c16", 16, 16, 4)
    assert load["requests"] == 64
    for row in (load, mem):
        assert row["lost"] == 0 and row["missing"] == 0 and row["duplicates"] == 0, row
        assert row["cross_wired"] == 0 and row["not_finished"] == 0, res["audit_examples"]
        assert row["overhead_n"] == row["requests"]  # a sampler time for every completion
    assert res["traces_stored"] == 16 + 8  # every finished trace, nothing else
    # The server's RSS: sampled before the memory run and after every 4 ended rollouts.
    assert [s["rollouts_ended"] for s in res["rss"]] == [0, 4, 8]
    assert all(s["rss_bytes"] > 0 for s in res["rss"]) and res["rss_end_bytes"] > 0
    with open(out) as f:
        assert json.load(f)["rows"] == json.loads(json.dumps(res["rows"]))


def test_thread_mode_latency_rows_cover_every_request_api(tmp_path):
    """Toy size: the latency table has the direct call and each HTTP route (chat
    completions with the admin and a rollout key, messages, responses), every
    request returning the same number of greedy tokens."""
    out = tmp_path / "bench.json"
    lat, tp = bench_endpoint.main([
        "--clients=2", "--latency_requests=3", "--throughput_requests=4", "--max_tokens=4",
        "--out", str(out)])
    assert [r["impl"] for r in lat] == [
        "direct", "http_admin", "http_rollout", "http_messages", "http_responses"]
    assert all(r["n"] == 3 and r["p50_ms"] > 0 for r in lat)
    assert {r["impl"] for r in tp} == {"direct", "http"}
    with open(out) as f:
        saved = json.load(f)
    assert saved["machine"]["cpu_model"] and "vector_extensions" in saved["machine"]
