"""experiments/whole_trace/analysis.py: per-task pooling over runs."""

import os

import numpy as np


def test_pooled_arm_difference_averages_runs_per_task(tmp_path):
    from ac2_jax.trace import Trace, TraceStore
    from experiments.whole_trace.analysis import pooled_arm_difference

    def store(run, arm, passes):  # passes: {task: [pass per attempt]}
        os.makedirs(tmp_path / run, exist_ok=True)
        s = TraceStore(str(tmp_path / run / f"served_{arm}.jsonl"))
        for task, ok in passes.items():
            for a, p in enumerate(ok):
                s.append(Trace(task_id=task, status="finished", reward=float(p),
                               metadata={"eval": f"rl_{arm}", "attempt": a}))
        s.append(Trace(task_id="t0", status="finished", reward=1.0,  # an RL rollout: ignored
                       metadata={"rl_step": 0}))

    store("a", "whole", {"t0": [1, 1], "t1": [1, 0], "t2": [0, 0]})
    store("a", "main_only", {"t0": [1, 0], "t1": [0, 0], "t2": [0, 0]})
    store("b", "whole", {"t0": [1, 1], "t1": [0, 0], "t2": [1, 0], "t3": [1, 1]})
    store("b", "main_only", {"t0": [0, 0], "t1": [0, 0], "t2": [0, 0], "t3": [0, 0]})
    est = pooled_arm_difference([str(tmp_path / "a"), str(tmp_path / "b")])
    # Per task, mean over runs of (whole - main only): t0 (0.5+1)/2, t1 (0.5+0)/2, t2 (0+0.5)/2;
    # t3 is only in run b and is left out.
    expected = [0.75, 0.25, 0.25]
    assert est.n == 3 and abs(est.mean - np.mean(expected)) < 1e-12
    half = 4.302652729911275 * np.std(expected, ddof=1) / np.sqrt(3)  # t(2) at 95%
    assert abs(est.high - est.mean - half) < 1e-9
    single = pooled_arm_difference([str(tmp_path / "a")])
    assert abs(single.mean - np.mean([0.5, 0.5, 0.0])) < 1e-12


def test_eval_figures_skip_infra_errors_rollouts_and_repeats(tmp_path):
    from ac2_jax.trace import Trace, TraceStore
    from experiments.whole_trace.analysis import eval_judged_by_task, eval_pass_by_task

    def ev(task, attempt, reward, status="finished", memos=()):
        return Trace(task_id=task, status=status, reward=reward, metadata={
            "eval": "rl_whole", "attempt": attempt,
            "artifacts": {"events": [{"kind": "compaction", "memo_ok": m} for m in memos]}})
    s = TraceStore(str(tmp_path / "served.jsonl"))
    s.append(ev("t0", 0, None, "infra_error"))      # retried: not an attempt
    s.append(ev("t0", 0, 1.0, memos=(True, None)))   # the retry; None: not judged
    s.append(ev("t0", 1, 0.0, memos=(False,)))
    s.append(ev("t1", 0, 0.0, memos=(True,)))
    s.append(ev("t1", 0, 1.0, memos=(True, True)))   # the same attempt again (resumed run)
    s.append(Trace(task_id="t1", status="finished", reward=0.0, metadata={"rl_step": 0}))
    assert eval_pass_by_task(str(tmp_path / "served.jsonl"), "rl_whole") == {"t0": 0.5, "t1": 1.0}
    assert eval_judged_by_task(str(tmp_path / "served.jsonl"), "rl_whole") == {
        "t0": 0.5, "t1": 1.0}


def test_a_store_is_read_once_until_it_changes(tmp_path, monkeypatch):
    """The pooling asks each store for many figures: it is read once while unchanged, and
    read again once a trace is appended (a resumed run)."""
    from ac2_jax.trace import Trace, TraceStore
    from experiments.whole_trace import analysis as aa

    path = str(tmp_path / "served.jsonl")
    s = TraceStore(path)
    s.append(Trace(task_id="t0", status="finished", reward=1.0,
                   metadata={"eval": "rl_whole", "attempt": 0}))
    reads = []
    real = TraceStore.read
    monkeypatch.setattr(TraceStore, "read", lambda self, **k: reads.append(1) or real(self, **k))
    assert aa.eval_pass_by_task(path, "rl_whole") == {"t0": 1.0}
    assert aa.eval_pass_by_task(path, "rl_whole") == {"t0": 1.0}
    assert aa.eval_judged_by_task(path, "rl_whole") == {}
    assert len(reads) == 1
    s.append(Trace(task_id="t1", status="finished", reward=0.0,
                   metadata={"eval": "rl_whole", "attempt": 0}))
    assert aa.eval_pass_by_task(path, "rl_whole") == {"t0": 1.0, "t1": 0.0}
    assert len(reads) == 2


def test_the_recovered_share_needs_a_reference_gain_that_excludes_zero():
    from experiments.whole_trace.analysis import recovered_share

    assert recovered_share(0.02, 0.04, {"mean": 0.04, "low": 0.01, "high": 0.07}) == (0.5, None)
    share, note = recovered_share(0.021, 0.002, {"mean": 0.002, "low": -0.011, "high": 0.015})
    assert share is None and "0.002 [-0.011, 0.015], does not exclude 0" in note
    assert recovered_share(0.02, 0.0, None)[0] is None
