"""The text-to-SQL example env: a generated sqlite db, read-only tool, result-set reward."""

import asyncio

from ac2_jax.envs import check_env, run_tool
from examples.text_to_sql.env import TextToSQLEnv


def test_tasks_are_deterministic_and_the_splits_disjoint():
    env = TextToSQLEnv()
    assert [t.task_id for t in env.sample_tasks(6, 2)] == [t.task_id for t in env.sample_tasks(6, 2)]
    train = {t.prompt for t in env.sample_tasks(30, seed=0, split="train")}
    test = {t.prompt for t in env.sample_tasks(30, seed=0, split="eval")}
    assert not train & test
    for recipe in ("rl", "sft", "distill"):
        check_env(env, recipe)


def test_wrong_invalid_and_writing_queries_score_zero():
    env = TextToSQLEnv()
    task = env.sample_tasks(1, seed=0)[0]
    assert env.verify(task, env.reference_answer(task)) == 1.0
    assert env.verify(task, None) == 0.0
    assert env.verify(task, "SELEC nothing") == 0.0
    assert env.verify(task, "SELECT 1") == 0.0
    assert env.verify(task, "DELETE FROM employees") == 0.0
    assert env.verify(task, env.reference_answer(task)) == 1.0  # the delete changed nothing


def test_the_tool_cannot_write_and_the_demonstration_is_real():
    env = TextToSQLEnv()
    tool = env.tool("run_sql")
    text, _ = asyncio.run(run_tool(tool, {"query": "DROP TABLE employees"}))
    assert "error" in text.lower() or "not authorized" in text.lower()
    count, ok = asyncio.run(run_tool(tool, {"query": "SELECT COUNT(*) FROM employees"}))
    assert ok and "error" not in count.lower()
    task = env.sample_tasks(1, seed=5)[0]
    demo = env.demonstration(task)
    for i, m in enumerate(demo):
        for call in m.get("tool_calls") or []:
            text, _ = asyncio.run(run_tool(env.tool(call["function"]["name"]),
                                           call["function"]["arguments"]))
            assert demo[i + 1]["content"] == text
    assert env.verify(task, demo[-1]["content"]) == 1.0 and env.hint(task)
