"""Trace types: the one status vocabulary of `Trace.status` (TraceStatus)."""

import json

import pytest

from ac2_jax.trace import Completion, Trace, TraceStore
from ac2_jax.trace.types import END_STATUSES, RESULT_STATUSES, TRACE_STATUSES, TraceStatus


def test_statuses_are_the_failure_taxonomy():
    assert TRACE_STATUSES == ("running", "finished", "agent_error", "timed_out", "infra_error")
    for status in TRACE_STATUSES:
        t = Trace(task_id="t", status=status)
        assert Trace.from_dict(json.loads(json.dumps(t.to_dict()))) == t


def test_one_status_enum_and_an_unknown_status_is_refused(tmp_path):
    """One vocabulary (TraceStatus); no shim: an old "failed" is an error naming it."""
    assert TRACE_STATUSES == tuple(TraceStatus)
    assert END_STATUSES == tuple(s for s in TRACE_STATUSES if s != "running")
    assert set(RESULT_STATUSES) < set(END_STATUSES)
    assert json.dumps(Trace("t", status=TraceStatus.TIMED_OUT).to_dict()["status"]) == '"timed_out"'
    old = {"task_id": "t", "attempt_id": "3", "episodes": [], "status": "failed"}
    with pytest.raises(ValueError, match=r"Trace.status must be one of .*got 'failed'"):
        Trace.from_dict(old)
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps({"schema": 1, "trace": old}) + "\n")
    with pytest.raises(ValueError, match="failed"):
        TraceStore(str(path)).load()


def test_default_attempt_ids_keep_attempts_apart():
    """With attempt_id defaulting to "0", two attempts at one task merged into one loss group."""
    a, b = Trace("t"), Trace("t")
    assert a.key != b.key
    assert Trace.from_dict(a.to_dict()).key == a.key  # a stored id is kept
    assert Trace.from_dict({"task_id": "t"}).key != Trace.from_dict({"task_id": "t"}).key


def test_completion_records_its_sampling_params():
    c = Completion([1, 2], [3], [-0.2], temperature=0.3, top_k=20, top_p=0.9)
    back = Completion.from_dict(c.to_dict())
    assert (back.temperature, back.top_k, back.top_p) == (0.3, 20, 0.9)
    old = {k: v for k, v in c.to_dict().items() if k not in ("temperature", "top_k", "top_p")}
    assert (Completion.from_dict(old).temperature, Completion.from_dict(old).top_k) == (1.0, 0)


def test_completion_records_its_constraint_and_old_ones_load_without_it():
    g = '{"grammars": [{"json_schema": {"type": "object"}}]}'
    c = Completion([1, 2], [3], [0.0], constraint=g)
    assert Completion.from_dict(json.loads(json.dumps(c.to_dict()))).constraint == g
    free = Completion([1, 2], [3], [-0.2])
    assert "constraint" not in free.to_dict()  # written as older stores wrote it
    assert Completion.from_dict(free.to_dict()).constraint is None


def test_old_traces_with_full_messages_on_every_completion_load(tmp_path):
    msgs = [{"role": "user", "content": "hi"}]
    old = {"prompt_ids": [1], "output_ids": [2], "output_logprobs": [-0.5], "policy_version": 0,
           "finish_reason": "stop", "timings": {}, "cached_tokens": 0, "messages": msgs,
           "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    trace = {"task_id": "t", "attempt_id": "a", "episodes": [
        {"agent": "main", "token_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 0, 1],
         "sampler_logprobs": [0, -0.5, 0, -0.5],
         "completions": [old, {**old, "prompt_ids": [1, 2, 3], "output_ids": [4],
                               "messages": msgs + [{"role": "user", "content": "more"}]}]}]}
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps({"schema": 1, "trace": trace}) + "\n")
    (loaded,) = TraceStore(str(path)).load()
    ep = loaded.episodes[0]
    assert ep.messages_at() == [msgs, msgs + [{"role": "user", "content": "more"}]]
    assert "messages_sha" not in ep.completions[0].to_dict()  # written back as it was read


def test_events_are_the_harness_events_run_rollout_stores(tmp_path):
    """Trace.events reads metadata["artifacts"]["events"] (where run_rollout stores the
    harness's compaction events); [] when absent; a stored trace reads back the same."""
    assert Trace(task_id="t").events == []
    assert Trace(task_id="t", metadata={"artifacts": {"error": "x"}}).events == []
    events = [{"agent": "compactor", "kind": "compaction", "memo": "at 17", "memo_ok": True}]
    t = Trace(task_id="t", metadata={"artifacts": {"answer": "17", "events": events}})
    assert t.events == events
    t.events.append({"kind": "other"})  # a copy: the trace is not changed through it
    assert t.events == events
    store = TraceStore(str(tmp_path / "t.jsonl"))
    store.append(t)
    assert store.load()[0].events == events
