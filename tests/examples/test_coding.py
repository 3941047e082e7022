"""The coding example env: tasks, the sandboxed tool, hidden-test grading."""

import asyncio

from ac2_jax.envs import check_env, run_tool
from examples.coding.env import CodingEnv, extract_code


def test_tasks_are_deterministic_and_the_splits_disjoint():
    env = CodingEnv()
    a, b = env.sample_tasks(8, seed=3), env.sample_tasks(8, seed=3)
    assert [t.task_id for t in a] == [t.task_id for t in b]
    train = {t.prompt for t in env.sample_tasks(40, seed=0, split="train")}
    test = {t.prompt for t in env.sample_tasks(40, seed=0, split="eval")}
    assert train and test and not train & test
    for recipe in ("rl", "sft", "distill"):
        check_env(env, recipe)


def test_wrong_crashing_and_looping_code_scores_zero():
    env = CodingEnv()
    task = next(t for t in env.sample_tasks(20, seed=0) if t.domain == "clamp")
    assert env.verify(task, env.reference_answer(task)) == 1.0
    assert env.verify(task, None) == 0.0 == env.verify(task, "")
    assert env.verify(task, "def clamp(x):\n    return x\n") < 1.0
    assert env.verify(task, "raise SystemExit(3)") == 0.0
    assert env.verify(task, "def clamp(x):\n    while True:\n        pass\n") == 0.0
    assert env.verify(task, "syntax error here(") == 0.0
    assert extract_code("see\n```python\nx = 1\n```\n") == "x = 1\n"


def test_the_demonstration_records_what_the_tool_returns_and_passes():
    env = CodingEnv()
    task = env.sample_tasks(1, seed=1)[0]
    demo = env.demonstration(task)
    call = demo[-3]["tool_calls"][0]["function"]
    text, ok = asyncio.run(run_tool(env.tool(call["name"]), call["arguments"]))
    assert ok and demo[-2]["content"] == text
    assert env.verify(task, demo[-1]["content"]) == 1.0
    assert env.hint(task)
