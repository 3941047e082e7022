"""benchmarks/endpoint_fleet_load.py at toy size: 3 client processes x 2 turns against the
endpoint over a fleet of 2 backend processes while a publisher process publishes weights
and has the endpoint load them. Nothing lost, never stored, duplicated or cross-wired; the
figures are there (their values go to a dated note, docs/notes/2026-12-05-faults-across-processes.md, never
asserted)."""

from benchmarks.endpoint_fleet_load import run


def test_client_processes_against_a_fleet_while_weights_are_published(tmp_path):
    res = run(str(tmp_path), clients=3, turns=2, backends=2, max_tokens=4, max_context=256,
              publish_every_s=1.0, warmup=False)
    assert res["client_processes"] == 3 and res["requests"] == 3 * 2
    assert res["lost"] == res["missing"] == res["duplicates"] == res["cross_wired"] == 0
    assert res["weight_loads"] >= 1 and res["weight_loads_ok"] == res["weight_loads"]
    assert res["latency_p50_ms"] > 0 and res["req_per_s"] > 0
    assert res["fleet"]["live"] == 2 and len(res["fleet"]["backends"]) == 2
    assert set(res["versions_sampled"]) <= {0} | {x for x in range(1, res["weight_loads"] + 1)}
