"""The subagent variant's parts (experiments/calculator/subagent_helper.py): the demonstrator, the
judged spawns and where the main agent slips."""

import random

import pytest

from experiments.calculator import agent as ca
from experiments.calculator import long_horizon, subagent_helper
from experiments.calculator.config import get_config


def test_subtask_result():
    assert subagent_helper.subtask_result("Start at 512. Apply +37, 2 times.") == 586
    assert subagent_helper.subtask_result("Start at 512. Apply +37, 0 times.") == 512
    assert subagent_helper.subtask_result("add these up") is None


def test_helper_policy_delegates_and_the_helper_stops_early_when_told():
    rng = random.Random(0)
    task = "Start at 512. Apply +37, 2 times."
    main = [{"role": "system", "content": "s"}, {"role": "user", "content": task}]
    spawn = subagent_helper.helper_policy("main", main, rng, stop_early_prob=0.0)
    fn = spawn["tool_calls"][0]["function"]
    assert fn["name"] == "spawn_subagent"
    assert fn["arguments"] == '{"name": "helper", "task": "Start at 512. Apply +37, 2 times."}'
    done = main + [{"role": "assistant", "content": "", "tool_calls": spawn["tool_calls"]},
                   {"role": "tool", "content": "The answer is 586."}]
    assert subagent_helper.helper_policy("main", done, rng, stop_early_prob=0.0) == {
        "role": "assistant", "content": "The answer is 586."}
    helper = [{"role": "user", "content": task}]
    first = subagent_helper.helper_policy(subagent_helper.AGENT, helper, rng, stop_early_prob=1.0)
    assert first["tool_calls"][0]["function"]["arguments"] == '{"expression": "512+37"}'
    after = helper + [first, {"role": "tool", "content": "549"}]
    assert subagent_helper.helper_policy(subagent_helper.AGENT, after, rng,
                                         stop_early_prob=1.0)["content"] == "The answer is 549."
    go_on = subagent_helper.helper_policy(subagent_helper.AGENT, after, rng, stop_early_prob=0.0)
    assert go_on["tool_calls"][0]["function"]["arguments"] == '{"expression": "549+37"}'


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = get_config("sub_helper")
    env = ca.build_env(cfg)
    tok = ca.build_tokenizer(cfg, str(tmp_path_factory.mktemp("tok")), env)
    return cfg, env, tok


def test_demos_judge_every_spawn_and_early_stops_fail(setup):
    cfg, env, tok = setup
    tasks = env.sample_tasks(40, seed=3)
    make = ca.orchestrator_factory({}, cfg.rollout.max_steps, cfg)
    demos = long_horizon.record_demos(env, tasks, tok, make, ca.demo_policy(cfg, random.Random(1)))
    verdicts = []
    for t, (conv, requests) in zip(tasks, demos):
        [event] = [e for e in conv.events if e.get("kind") == "subagent"]
        assert event["agent"] == subagent_helper.AGENT and event["task"] == t.prompt
        # The main agent copies the helper's number: the attempt passes exactly when the
        # helper was right.
        assert (env.verify(t, conv.answer) == 1.0) == event["helper_ok"]
        agents = [a for a, *_ in requests]
        assert agents.count("main") == 2 and agents.count(subagent_helper.AGENT) in (2, 3)
        verdicts.append(event["helper_ok"])
    assert 0 < sum(verdicts) < len(verdicts)  # stop_early_prob 0.5: some of each
    segments, stats = long_horizon.long_demo_segments(
        env, tasks[:8], tok, make, ca.demo_policy(cfg, random.Random(1)), log=lambda *a: None,
        judged="helper_ok")
    assert stats["segments"] == {"main": 8, subagent_helper.AGENT: 8}  # one per episode
    assert max(len(s.tokens) for s in segments) <= cfg.model.max_position_embeddings


def test_main_request_accuracy_counts_spawns_and_answers(setup):
    from ac2_jax.trace import Trace
    from ac2_jax.trace.types import Completion, Episode
    cfg, env, tok = setup
    task = "Start at 512. Apply +37, 2 times."

    def comp(prompt, out):
        out_ids = tok.encode(out)
        return Completion(prompt_ids=tok.encode(prompt), output_ids=out_ids,
                          output_logprobs=[0.0] * len(out_ids))
    good = ('<tool_call>\n{"name": "spawn_subagent", "arguments": {"name": "helper", '
            f'"task": "{task}"}}}}\n</tool_call>')
    bad = good.replace("512", "521")
    result = "<tool_response>\nThe answer is 586.\n</tool_response>"
    traces = [Trace(task_id="a", episodes=[Episode(agent="main", completions=[
        comp(task, good), comp(task + good + result, "The answer is 586.")])]),
        Trace(task_id="b", episodes=[Episode(agent="main", completions=[
            comp(task, bad), comp(task + bad + result, "The answer is 568.")])])]
    # The helper gave no answer: the main agent's second request is still an answer.
    failed = "<tool_response>\n(subagent helper gave no answer: step_limit)\n</tool_response>"
    traces.append(Trace(task_id="c", episodes=[Episode(agent="main", completions=[
        comp(task, good), comp(task + good + failed, "The answer is 586.")])]))
    acc = subagent_helper.main_request_accuracy(traces, tok)
    assert acc == {"answer": {"n": 3, "correct": 1, "rate": 1 / 3},
                   "first_call": {"n": 3, "correct": 2, "rate": 2 / 3}}
