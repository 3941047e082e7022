"""Environment QA audit: planted faults are flagged, an honest env passes.

Traces are built with the library's own types (Trace, Completion via
TraceRecorder), their tool results by the env's real tool and their rewards
by the env's real verifier; the runner test goes through the real endpoint.
"""

import asyncio
import json
import random

import pytest

from ac2_jax.envs import CalculatorEnv, DomainMixer, run_tool
from ac2_jax.evals import AuditConfig, audit, audit_traces, count_tool_calls, no_tool_call
from ac2_jax.orchestration import DefaultOrchestrator, LifecycleClient
from ac2_jax.trace import Completion, Trace, TraceRecorder
from tests.support.serving_helpers import served_random_model

PREDICATES = {"no_tool_call": no_tool_call}


def _completion(messages, n_out=2):
    return Completion(list(range(1, 4 + len(messages))), list(range(50, 50 + n_out)),
                      [-0.3] * n_out, messages=[dict(m) for m in messages])


def _trace(env, task, attempt, *, use_tool, answer_offset=0, guess=None, metrics=True):
    """One attempt as the endpoint records it. With the tool: call it (really),
    answer its result + answer_offset. Without: answer `guess` straight away."""
    msgs = env.initial_messages(task)
    trace = Trace(task.task_id, str(attempt), group_id=task.task_id, status="finished")
    rec = TraceRecorder(trace)
    rec.record("main", _completion(msgs))
    calls = 0
    if use_tool:
        args = json.dumps({"expression": task.metadata["expression"]})
        result, ok = asyncio.run(run_tool(env.tool("calculator"), args))
        assert ok
        call = {"id": f"call_{attempt}", "type": "function",
                "function": {"name": "calculator", "arguments": args}}
        msgs = msgs + [{"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": call["id"], "content": result}]
        rec.record("main", _completion(msgs))
        answer, calls = f"The answer is {int(result) + answer_offset}.", 1
    else:
        answer = f"The answer is {guess}."
    trace.reward = env.verify(task, answer)
    trace.metadata["artifacts"] = {"answer": answer, "orchestrator_status": "finished"}
    if metrics:
        trace.metrics = {"tool_calls": calls}
    return trace


def _honest(env, tasks, attempts=4):
    """Every attempt uses the tool; every other one miscopies its result (wrong, reward 0)."""
    return [_trace(env, t, a, use_tool=True, answer_offset=a % 2) for t in tasks
            for a in range(attempts)]


class GameableEnv(CalculatorEnv):
    """Planted fault: any 'The answer is N.' passes, whatever N is."""

    def verify(self, task, answer):
        return float("answer is" in (answer or ""))


class CoinFlipEnv(CalculatorEnv):
    """Planted fault: a random verdict (seeded, so the test is reproducible)."""

    def __init__(self, seed=0):
        super().__init__()
        self.rng = random.Random(seed)

    def verify(self, task, answer):
        return float(self.rng.random() < 0.5)


class DoubleRewardEnv(CalculatorEnv):
    """Planted fault: rewards of 2 for a right answer, outside reward_range (0, 1)."""

    def verify(self, task, answer):
        return 2.0 * super().verify(task, answer)


class WrongKeyEnv(CalculatorEnv):
    """Planted fault: task 0's stored answer is off by 1000, so nothing can solve it."""

    def sample_tasks(self, n, seed, split="train"):
        tasks = super().sample_tasks(n, seed, split)
        tasks[0].answer += 1000
        return tasks


def test_an_honest_calculator_env_is_clean():
    env = CalculatorEnv()
    tasks = env.sample_tasks(3, seed=0)
    report = audit_traces(env, tasks, _honest(env, tasks),
                          AuditConfig(predicates=PREDICATES))
    assert report.clean, report.flags
    assert all(not ids for ids in report.flags.values())
    assert report.pass_rates == {t.task_id: 0.5 for t in tasks}
    assert report.counts["reverifications"] == 12 * 3
    assert "tasks_without_reference" not in report.counts
    assert json.loads(json.dumps(report.to_dict()))["clean"] is True


def test_a_gameable_verifier_is_flagged_by_the_no_tool_call_predicate():
    env = GameableEnv()
    tasks = env.sample_tasks(3, seed=0)
    gamed = [_trace(env, t, 10 + a, use_tool=False, guess=5) for t in tasks[:2] for a in range(2)]
    traces = _honest(env, tasks) + gamed
    assert all(t.reward == 1.0 for t in gamed)  # the planted fault: wrong guesses pass
    report = audit_traces(env, tasks, traces, AuditConfig(predicates=PREDICATES))
    assert not report.clean
    assert report.flags["no_tool_call"] == sorted(t.task_id for t in tasks[:2])
    assert {(d["task_id"], d["attempt_id"]) for d in report.details["no_tool_call"]} == {
        (t.task_id, t.attempt_id) for t in gamed}
    assert [c for c, ids in report.flags.items() if ids] == ["always_solved", "no_tool_call"]
    # The same gaming attempts under the honest verifier earn nothing: nothing to flag.
    honest = CalculatorEnv()
    traces = _honest(honest, tasks) + [_trace(honest, t, 10, use_tool=False, guess=5)
                                       for t in tasks[:2]]
    assert audit_traces(honest, tasks, traces, AuditConfig(predicates=PREDICATES)).clean


def test_a_nondeterministic_verifier_is_flagged():
    env = CoinFlipEnv(seed=0)
    tasks = env.sample_tasks(3, seed=0)
    report = audit_traces(env, tasks, _honest(env, tasks), AuditConfig(reverify=5))
    assert report.flags["nondeterministic_verifier"] == sorted(t.task_id for t in tasks)
    assert not report.clean
    d = report.details["nondeterministic_verifier"][0]
    assert d["stored"] != d["reverified"]


def test_rewards_outside_the_range_and_an_unsolvable_task_are_flagged():
    env = DoubleRewardEnv()
    tasks = env.sample_tasks(2, seed=0)
    report = audit_traces(env, tasks, _honest(env, tasks))
    assert report.flags["reward_out_of_range"] == sorted(t.task_id for t in tasks)
    assert {d["source"] for d in report.details["reward_out_of_range"]} == {
        "trace", "reverify", "reference"}
    env = WrongKeyEnv()
    tasks = env.sample_tasks(3, seed=0)
    report = audit_traces(env, tasks, _honest(env, tasks))
    assert report.flags["unsolvable"] == [tasks[0].task_id]
    assert report.flags["never_solved"] == [tasks[0].task_id]  # advisory
    assert report.details["unsolvable"][0]["reward"] == 0.0 and not report.clean


def test_pass_rate_curves_and_sudden_jumps_across_checkpoints():
    env = CalculatorEnv()
    a, b = env.sample_tasks(2, seed=0)

    def attempts(task, right):  # 4 attempts with the tool, `right` of them copied right
        return [_trace(env, task, i, use_tool=True, answer_offset=int(i >= right))
                for i in range(4)]

    by_checkpoint = {"step_0": attempts(a, 0) + attempts(b, 2),
                     "step_50": attempts(a, 1) + attempts(b, 2),
                     "step_100": attempts(a, 4) + attempts(b, 3)}
    report = audit_traces(env, [a, b], by_checkpoint["step_100"],
                          AuditConfig(jump_threshold=0.5), by_checkpoint=by_checkpoint)
    assert report.checkpoints == ["step_0", "step_50", "step_100"]
    assert report.curves == {a.task_id: [0.0, 0.25, 1.0], b.task_id: [0.5, 0.5, 0.75]}
    assert report.flags["sudden_jump"] == [a.task_id]
    assert report.details["sudden_jump"] == [{"task_id": a.task_id,
                                              "checkpoints": ["step_50", "step_100"],
                                              "pass_rates": [0.25, 1.0]}]
    assert report.flags["always_solved"] == [a.task_id] and not report.clean


def test_tool_calls_are_counted_from_recorded_requests_and_skips_are_counted():
    env = CalculatorEnv()
    task = env.sample_tasks(1, seed=0)[0]
    assert count_tool_calls(_trace(env, task, 0, use_tool=True, metrics=False)) == 1
    assert count_tool_calls(_trace(env, task, 1, use_tool=False, guess=3, metrics=False)) == 0
    broken = Trace(task.task_id, "9", status="infra_error")  # no verdict: not judged
    report = audit_traces(env, [task], [broken, _trace(env, task, 0, use_tool=True)])
    assert report.counts["traces_without_verdict"] == 1
    assert report.counts["traces_not_reverified"] == 1
    assert report.counts["tasks_with_too_few_attempts"] == 1


def test_bad_configs_and_traces_of_unknown_tasks_are_refused():
    for bad, what in ((dict(reverify=-1), "reverify"), (dict(min_attempts=0), "min_attempts"),
                      (dict(jump_threshold=0.0), "jump_threshold"),
                      (dict(predicates={"unsolvable": no_tool_call}), "built-in"),
                      (dict(predicates={"x": 3}), "callables"),
                      (dict(advisory=("nope",)), "unknown checks")):
        with pytest.raises(ValueError, match=what):
            AuditConfig(**bad)
    env = CalculatorEnv()
    task = env.sample_tasks(1, seed=0)[0]
    other = Trace("elsewhere-1", "0", status="finished", reward=1.0)
    with pytest.raises(ValueError, match="tasks not given"):
        audit_traces(env, [task], [other])


def test_runner_audits_a_mixer_through_the_endpoint(tmp_path):
    """audit(): K attempts per task through the real endpoint (a tiny random model),
    then the checks; a DomainMixer's tasks are verified by their own env."""
    mix = DomainMixer({"calc": CalculatorEnv(), "game": GameableEnv()})
    tasks = mix.sample_tasks(4, seed=0)

    def make(env, task, client, model):
        return DefaultOrchestrator(env, task, client, model, max_steps=1,
                                   sampling={"temperature": 1.0, "max_tokens": 6})

    async def go(url):
        lc = LifecycleClient(url, "sk-admin-audit")
        try:
            return await audit(lc, mix, tasks, make, "tiny", attempts=2,
                               config=AuditConfig(predicates=PREDICATES))
        finally:
            await lc.aclose()

    with served_random_model(tmp_path, "sk-admin-audit", max_context=512) as (url, _):
        report, traces = asyncio.run(go(url))
    assert len(traces) == 8 and {t.task_id for t in traces} == {t.task_id for t in tasks}
    assert report.counts["tasks"] == 4 and report.counts["traces"] == 8
    judged = [t for t in traces if t.status in ("finished", "agent_error")]
    assert report.counts.get("reverifications", 0) == 3 * len(judged)
    # Random 6-token answers: the honest verifier never passes them; the references pass.
    assert not report.flags["unsolvable"] and not report.flags["nondeterministic_verifier"]
    assert all(report.pass_rates[t.task_id] == 0.0 for t in tasks if t.domain == "calc")
