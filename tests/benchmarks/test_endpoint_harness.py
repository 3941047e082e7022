"""benchmarks/endpoint_harness: the audit catches what it must, and the fault
test: SIGKILL the server (its own process) mid-load, restart it on the same
store; finished traces intact, running rollouts reported lost."""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.trace import Completion, Episode, Trace, TraceStore
from benchmarks.endpoint_harness import ServerProcess, audit, find_markers, lost_rollouts, marker
from benchmarks.endpoint_harness import main as harness_main
from tests.support.child_env import child_xla_flags

ADMIN = "sk-harness-admin"
# The server as deployed: one CPU device (the suite's compile flags: tests/support/child_env.py).
CHILD_ENV = {"XLA_FLAGS": child_xla_flags()}
# Small shapes: few compiles, fast decode steps on CPU.
SERVER_FLAGS = ["--max_tokens=2", "--max_context=256", "--max_batch=8"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def _trace(tok, run, index, prompts_markers, status="finished"):
    """A trace whose completion k has a prompt holding the given markers."""
    comps = []
    for ms in prompts_markers:
        text = "system: hi " + " ".join(f"Turn {t} {marker(r, i, t)}" for r, i, t in ms)
        comps.append(Completion(prompt_ids=tok.encode(text), output_ids=tok.encode(" ok"),
                                output_logprobs=[0.0] * len(tok.encode(" ok")),
                                timings={"sample_s": 0.25}))
    return Trace(task_id="t", episodes=[Episode(agent="main", completions=comps)], status=status,
                 metadata={"harness_run": run, "index": index})


def test_markers_round_trip_through_the_tiny_tokenizer(tok):
    text = "a" + marker("r1", 3, 7) + "b " + marker("r1", 12, 0)
    assert find_markers(tok.decode(tok.encode(text))) == [("r1", 3, 7), ("r1", 12, 0)]


def test_audit_flags_foreign_missing_duplicate_and_unfinished(tok):
    own = [[("r", 0, 0)], [("r", 0, 0), ("r", 0, 1)]]
    traces = [
        _trace(tok, "r", 0, own),  # ok
        _trace(tok, "r", 1, [[("r", 1, 0)], [("r", 1, 0), ("r", 2, 1)]]),  # another's turn
        _trace(tok, "r", 3, [[("r", 3, 0)]]),  # a turn missing
        _trace(tok, "r", 4, [[("r", 4, 0)], [("r", 4, 0)]]),  # turn 0 twice, turn 1 never
        _trace(tok, "r", 5, [[("r", 5, 0)]], status="infra_error"),  # ended early: ok content
        _trace(tok, "r", 5, [[("r", 5, 0)]], status="infra_error"),  # stored twice
        _trace(tok, "other", 9, own),  # another run: ignored
    ]
    a = audit(traces, "r", rollouts=7, turns=2, decode=tok.decode)
    assert a["stored"] == [0, 1, 3, 4, 5]
    assert a["missing"] == [2, 6]
    assert a["duplicates"] == [5]
    assert a["not_finished"] == {5: "infra_error"}
    assert sorted({i for i, _ in a["cross_wired"]}) == [1, 3, 4]
    assert a["sample_s"][(0, 1)] == 0.25


def test_lost_rollouts_lists_created_but_unstored():
    report = {"results": [
        {"index": 0, "rollout_id": "ro-a", "turns_done": 3, "error": None, "status": "finished"},
        {"index": 1, "rollout_id": "ro-b", "turns_done": 1, "error": "turn 1: x", "status": "lost"},
        {"index": 2, "rollout_id": None, "turns_done": 0, "error": "create: y",
         "status": "not_created"}]}
    assert lost_rollouts(report, stored=[0]) == [
        {"index": 1, "rollout_id": "ro-b", "turns_done": 1, "error": "turn 1: x"}]


def _harness(url, run_id, out, **kw):
    """`python -m benchmarks.endpoint_harness ARGS` (its `main`: flags, --progress, --out)
    in a thread of this process: only the server needs its own process, to be SIGKILLed;
    a client process cost a second Python start-up with openai's import. Returns the
    thread; `thread.error` holds what `main` raised, if anything."""
    args = ["--url", url, "--admin_key", ADMIN, "--run_id", run_id, "--out", str(out)]
    for k, v in kw.items():
        args += [f"--{k}", str(v)]

    def run():
        try:
            harness_main(args)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            thread.error = e

    thread = threading.Thread(target=run, name=f"harness-{run_id}", daemon=True)
    thread.error = None
    thread.start()
    return thread


def _progress(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def test_sigkill_mid_load_then_restart_on_the_same_store(tmp_path, tok):
    store_path = str(tmp_path / "traces.jsonl")
    server = ServerProcess(store_path, ADMIN, str(tmp_path / "server.log"),
                           flags=SERVER_FLAGS, env=CHILD_ENV)
    url = server.start()
    progress = tmp_path / "progress.jsonl"
    harness = _harness(url, "kill", tmp_path / "report.json", rollouts=16, turns=4,
                       concurrency=8, progress=progress, max_tokens=2)
    try:
        # Kill once some rollouts are stored and others still run (8 at a time).
        deadline = time.monotonic() + 120
        while sum(p["status"] == "finished" for p in _progress(progress)) < 2:
            assert harness.is_alive(), harness.error
            assert time.monotonic() < deadline, server.log_tail()
            time.sleep(0.05)
        server.kill()
        harness.join(timeout=120)
        assert not harness.is_alive() and harness.error is None, harness.error
    finally:
        server.kill()
    with open(tmp_path / "report.json") as f:
        report = json.load(f)
    with open(store_path, "rb") as f:
        on_disk = f.read()

    # Every trace on disk reads strictly and is exactly its own conversation.
    stored_traces = list(TraceStore(store_path).read(on_error="raise"))
    a = audit(stored_traces, "kill", 16, 4, tok.decode)
    assert a["cross_wired"] == [] and a["duplicates"] == [] and a["not_finished"] == {}
    finished = [r["index"] for r in report["results"] if r["status"] == "finished"]
    assert len(finished) >= 2 and set(finished) <= set(a["stored"])
    # Nothing silently gone: each rollout is stored, or reported lost / not created.
    lost = lost_rollouts(report, a["stored"])
    assert lost, "the kill hit no running rollout"
    assert {x["index"] for x in lost} <= set(report["lost"])
    assert all(x["error"] for x in lost)
    assert set(a["stored"]) | set(report["lost"]) | set(report["not_created"]) == set(range(16))
    assert report["finished"] + len(report["lost"]) + len(report["not_created"]) == 16

    # Restart on the same store: the old traces stay byte for byte, the server
    # does not know the lost rollouts (it keeps no record of running ones), and
    # it serves new rollouts, appended after the old ones.
    server2 = ServerProcess(store_path, ADMIN, str(tmp_path / "server2.log"),
                            flags=SERVER_FLAGS, env=CHILD_ENV)
    url2 = server2.start()
    try:
        r = httpx.get(f"{url2}/v1/rollouts/{lost[0]['rollout_id']}",
                      headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 404
        h2 = _harness(url2, "after", tmp_path / "report2.json", rollouts=2, turns=2, max_tokens=2)
        h2.join(timeout=120)
        assert not h2.is_alive() and h2.error is None, h2.error
    finally:
        server2.kill()
    with open(store_path, "rb") as f:
        after = f.read()
    assert after.startswith(on_disk)
    all_traces = list(TraceStore(store_path).read(on_error="raise"))
    assert len(all_traces) == len(stored_traces) + 2
    a2 = audit(all_traces, "after", 2, 2, tok.decode)
    assert a2["stored"] == [0, 1] and a2["cross_wired"] == [] and a2["not_finished"] == {}
