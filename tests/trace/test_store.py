"""TraceStore: exact round trips, corrupt lines reported, nothing valid lost."""

import json

import pytest

from ac2_jax.trace import Completion, Trace, TraceRecorder, TraceStore, TraceStoreError


def _trace(i):
    t = Trace(task_id=f"task{i}", attempt_id=str(i), group_id="g", reward=0.5 * i,
              hints=["use the tool"], status="finished", metrics={"steps": i},
              metadata={"domain": "calc"})
    rec = TraceRecorder(t)
    rec.record("main", Completion([1, 2, 3], [4, 5], [-0.25, -1.5], policy_version=i,
                                  timings={"sample_s": 0.01}, cached_tokens=2))
    rec.record("compactor", Completion([9], [8], [-0.125]))
    return t


def test_round_trip_exact(tmp_path):
    store = TraceStore(tmp_path / "traces.jsonl")
    traces = [_trace(i) for i in range(3)]
    store.extend(traces)
    loaded = store.load()
    assert [t.to_dict() for t in loaded] == [t.to_dict() for t in traces]
    assert loaded[1] == traces[1]
    assert len(store) == 3


def test_truncated_and_garbage_lines_reported(tmp_path):
    path = tmp_path / "traces.jsonl"
    store = TraceStore(path)
    store.append(_trace(0))
    with open(path, "a") as f:
        f.write("this is not json\n")
        f.write(json.dumps({"schema": 99, "trace": {}}) + "\n")
    store.append(_trace(1))
    full = json.dumps({"schema": 1, "trace": _trace(2).to_dict()})
    with open(path, "a") as f:
        f.write(full[: len(full) // 2])  # a writer died mid-line
    with pytest.raises(TraceStoreError, match=r"traces\.jsonl:2"):
        store.load()
    with pytest.warns(UserWarning) as record:
        ok = store.load(on_error="skip")
    assert [t.task_id for t in ok] == ["task0", "task1"]
    messages = " ".join(str(w.message) for w in record)
    for lineno in (2, 3, 5):
        assert f"traces.jsonl:{lineno}" in messages
    assert "schema" in messages and "truncated" in messages
    # Appending after a torn line never glues onto it; earlier traces survive.
    store.append(_trace(3))
    with pytest.warns(UserWarning):
        ok = store.load(on_error="skip")
    assert [t.task_id for t in ok] == ["task0", "task1", "task3"]


def test_bad_on_error_value(tmp_path):
    with pytest.raises(ValueError, match="on_error"):
        list(TraceStore(tmp_path / "x.jsonl").read(on_error="ignore"))


def test_read_is_a_list_and_iter_traces_streams(tmp_path):
    path = tmp_path / "traces.jsonl"
    store = TraceStore(path)
    store.extend([_trace(i) for i in range(3)])
    read = store.read()
    assert isinstance(read, list) and store.read()[0].task_id == "task0"
    assert [t.task_id for t in read] == [t.task_id for t in store.load()]
    # The generator reads lazily: a line appended after it started is still seen,
    # and a bad line after the first is only met when iteration reaches it.
    it = store.iter_traces()
    assert next(it).task_id == "task0"
    with open(path, "a") as f:
        f.write("not json\n")
    store.append(_trace(3))
    assert next(it).task_id == "task1" and next(it).task_id == "task2"
    with pytest.raises(TraceStoreError, match=r"traces\.jsonl:4"):
        next(it)
    with pytest.warns(UserWarning, match=r"traces\.jsonl:4"):
        assert [t.task_id for t in store.iter_traces(on_error="skip")] == [
            "task0", "task1", "task2", "task3"]
    for read in (store.read, lambda: [t for t in store]):  # iterating: on_error="raise"
        with pytest.raises(TraceStoreError, match=r"traces\.jsonl:4"):
            read()
    assert TraceStore(tmp_path / "missing.jsonl").read() == []
    assert list(TraceStore(tmp_path / "missing.jsonl").iter_traces()) == []


def test_skip_warnings_point_at_the_caller(tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_text("garbage\n")
    store = TraceStore(path)
    for read in (store.read, store.load, lambda **kw: list(store.iter_traces(**kw))):
        with pytest.warns(UserWarning) as record:
            assert read(on_error="skip") == []
        assert record[0].filename == __file__


def test_bad_on_error_value_is_refused_at_the_call(tmp_path):
    store = TraceStore(tmp_path / "x.jsonl")
    for method in (store.read, store.load, store.iter_traces):
        with pytest.raises(ValueError, match="on_error"):
            method(on_error="ignore")


def test_a_full_disk_is_a_clear_error_and_leaves_every_stored_trace_readable(tmp_path,
                                                                          monkeypatch):
    """ENOSPC mid-append (issue 42's fault harness: a quota on the store's disk cuts the
    write where the disk fills): the error names the store and the fix, the file is cut
    back to the traces stored before, so a strict read still holds every one of them
    and nothing torn; once there is room again appends go on."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ac2_jax.trace import store as store_mod
    from tests.support.fault_procs import quota_open

    path = tmp_path / "rollouts.jsonl"
    store = TraceStore(path)
    store.extend([_trace(0), _trace(1)])
    before = path.read_bytes()
    monkeypatch.setattr(store_mod, "open", quota_open(str(path), len(before) + 40),
                        raising=False)
    with pytest.raises(OSError, match=r"TraceStore: could not append .*rollouts.jsonl.*No "
                                      r"space left on device.*Free space") as e:
        store.append(_trace(2))
    assert e.value.errno == 28  # errno.ENOSPC kept for callers
    assert path.read_bytes() == before  # nothing lost, no torn line
    assert [t.task_id for t in store.read(on_error="raise")] == ["task0", "task1"]
    monkeypatch.setattr(store_mod, "open", open, raising=False)  # room again
    store.append(_trace(2))
    assert [t.task_id for t in store.read(on_error="raise")] == ["task0", "task1", "task2"]
