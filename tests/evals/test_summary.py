"""Attempt records from traces, and their summaries per task, domain and run."""

import json
from fractions import Fraction

import pytest

from ac2_jax.evals import (
    TokenPrices,
    attempt_record,
    clustered_interval,
    jsonable,
    mean_interval,
    pass_at_k,
    summarize,
    token_cost,
    wilson_interval,
)
from ac2_jax.trace import Completion, Episode, Trace

PRICES = TokenPrices(0.20, 2.00, 8.00)


def _trace(task_id, status="finished", reward=1.0, prompt=10, output=3, cached=4, steps=1):
    c = Completion(prompt_ids=list(range(prompt)), output_ids=[1] * output,
                   output_logprobs=[0.0] * output, cached_tokens=cached)
    return Trace(task_id=task_id, status=status, reward=reward,
                 episodes=[Episode(agent="main", completions=[c])],
                 metrics={"steps": steps, "tool_calls": 2, "tool_errors": 1, "wall_time_s": 0.5},
                 metadata={"artifacts": {"error": "boom"}} if status == "infra_error" else {})


def _rec(task_id, domain="a", attempt=0, infra_error="exclude", **kw):
    return attempt_record(_trace(task_id, **kw), domain=domain, attempt=attempt, seed=attempt,
                          infra_error=infra_error)


def test_attempt_record_scores_and_counts():
    r = _rec("t", steps=3)
    assert r.scored and r.passed and r.score == 1.0
    assert r.metrics["steps"] == 3 and r.metrics["tool_calls"] == 2 and r.metrics["episodes"] == 1
    assert (r.metrics["prompt_tokens"], r.metrics["cached_tokens"],
            r.metrics["uncached_tokens"], r.metrics["output_tokens"]) == (10, 4, 6, 3)
    assert r.prefix.requests == 1
    infra = _rec("t", status="infra_error", reward=None)
    assert not infra.scored and not infra.passed and infra.error == "boom"
    failed = _rec("t", status="infra_error", reward=None, infra_error="fail")
    assert failed.scored and not failed.passed and failed.score == 0.0
    timed = _rec("t", status="timed_out", reward=None)
    assert timed.scored and not timed.passed and timed.score == 0.0
    assert not _rec("t", reward=0.5).passed
    with pytest.raises(ValueError, match="exclude"):
        _rec("t", infra_error="zero")
    json.dumps(r.to_dict(), allow_nan=False)


def test_one_attempt_per_task_uses_wilson_and_counts_infra_errors():
    recs = [_rec(f"t{i}", reward=float(i % 2)) for i in range(9)]
    recs.append(_rec("t9", status="infra_error", reward=None))
    s = summarize(recs, prices=PRICES)["overall"]
    assert s["pass_rate"] == wilson_interval(4, 9)  # t9 left out, not scored 0
    assert (s["tasks"], s["tasks_scored"], s["scored_attempts"], s["excluded_infra_errors"]) == (
        10, 9, 9, 1)
    assert s["failures"] == {"finished": 9, "agent_error": 0, "timed_out": 0, "infra_error": 1}
    assert s["mean_reward"] == mean_interval([float(i % 2) for i in range(9)])
    assert list(s["pass_at_k"]) == ["1"] and s["pass_at_k"]["1"].mean == pytest.approx(4 / 9)
    assert s["process"]["steps"].mean == 1.0 and s["process"]["steps"].method == "t"
    assert s["tokens"]["prompt_tokens"] == 100  # token totals include the infra_error attempt
    assert s["cost"].total == token_cost(40, 60, 30, PRICES).total


def test_k_attempts_are_clustered_by_task_with_pass_at_k():
    outcomes = {"t0": [1, 1, 1, 1], "t1": [0, 0, 0, 0], "t2": [1, 0, 0, 1], "t3": [1, 1, 0, 1]}
    recs = [_rec(t, domain="a" if t < "t2" else "b", attempt=a, reward=float(v))
            for t, vs in outcomes.items() for a, v in enumerate(vs)]
    recs.append(_rec("t4", domain="b", attempt=0, reward=1.0))
    recs += [_rec("t4", domain="b", attempt=a, status="infra_error", reward=None)
             for a in (1, 2, 3)]
    out = summarize(recs, level=0.9, prices=PRICES)
    s = out["overall"]
    groups = [list(map(float, vs)) for vs in outcomes.values()] + [[1.0]]
    assert s["pass_rate"] == clustered_interval(groups, 0.9, bounds=(0.0, 1.0))
    assert s["pass_rate"].method == "clustered-t" and s["pass_rate"].n == 5
    assert list(s["pass_at_k"]) == ["1", "2", "4"]
    assert s["tasks_short_of_k"] == {"1": 0, "2": 1, "4": 1}  # t4 has one scored attempt
    want = sum(pass_at_k(4, sum(v), 2) for v in outcomes.values()) / 4
    assert s["pass_at_k"]["2"].mean == pytest.approx(want)
    assert s["pass_hat_k"]["4"].mean == pytest.approx(1 / 4)  # only t0 passes all four
    assert s["process"]["steps"].method == "clustered-t"
    assert set(out["per_domain"]) == {"a", "b"} and out["per_domain"]["a"]["tasks"] == 2
    t2 = out["per_task"]["t2"]
    assert t2["passes"] == 2 and t2["pass_at_k"]["2"] == pytest.approx(pass_at_k(4, 2, 2))
    assert out["per_task"]["t4"]["pass_at_k"] == {"1": 1.0}
    assert out["per_task"]["t4"]["failures"]["infra_error"] == 3
    # The run's cost is the sum of the per-task costs, exactly.
    assert sum((v["cost"].total for v in out["per_task"].values()), Fraction(0)) == s["cost"].total
    text = json.dumps(jsonable(out), allow_nan=False)
    assert json.loads(text)["overall"]["pass_rate"]["method"] == "clustered-t"


def test_nothing_scored_gives_none_not_zero():
    s = summarize([_rec("t", status="infra_error", reward=None)])["overall"]
    assert s["pass_rate"] is None and s["mean_reward"] is None and s["excluded_infra_errors"] == 1
    with pytest.raises(ValueError, match="no attempts"):
        summarize([])
