"""Trace types: the failure taxonomy of `Trace.status`, and old stored statuses."""

import json

from ac2_jax.trace import Trace, TraceStore
from ac2_jax.trace.types import TRACE_STATUSES


def test_statuses_are_the_failure_taxonomy():
    assert TRACE_STATUSES == ("running", "finished", "agent_error", "timed_out", "infra_error")
    for status in TRACE_STATUSES:
        t = Trace(task_id="t", status=status)
        assert Trace.from_dict(json.loads(json.dumps(t.to_dict()))) == t


def test_old_failed_traces_load_as_infra_error(tmp_path):
    """Old stores wrote "failed" for any crashed rollout (mostly our outages): never trained."""
    path = tmp_path / "old.jsonl"
    old = {"task_id": "t", "attempt_id": "3", "group_id": "g", "episodes": [], "reward": 0.0,
           "hints": [], "status": "failed", "metrics": {}, "metadata": {"rl_step": 2}}
    path.write_text(json.dumps({"schema": 1, "trace": old}) + "\n")
    (loaded,) = TraceStore(str(path)).load()
    assert loaded.status == "infra_error" and loaded.reward == 0.0
    assert loaded.metadata == {"rl_step": 2}
