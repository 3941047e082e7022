"""Calculator envs: safe evaluation, verifier, disjoint splits."""

import asyncio

import pytest

from ac2_jax.envs import CalculatorEnv, StepwiseCalculatorEnv, run_tool, safe_eval


def test_safe_eval():
    assert safe_eval("47*38+12") == 47 * 38 + 12
    assert safe_eval("(3+4)*-2") == -14
    for bad in ("__import__('os')", "2**10", "1/2", "a+1"):
        with pytest.raises(ValueError):
            safe_eval(bad)
    with pytest.raises(ValueError, match="at most 1"):
        safe_eval("1+2+3", max_ops=1)


def test_tasks_verify_and_splits():
    env = CalculatorEnv()
    train = env.sample_tasks(50, seed=0)
    assert train == env.sample_tasks(50, seed=0)  # deterministic
    evals = env.sample_tasks(50, seed=0, split="eval")
    assert not {t.prompt for t in train} & {t.prompt for t in evals}
    t = train[0]
    assert env.verify(t, f"The answer is {t.answer}.") == 1.0
    assert env.verify(t, f"The answer is {t.answer + 1}.") == 0.0
    assert env.verify(t, None) == 0.0
    text, ok = asyncio.run(run_tool(env.tool("calculator"),
                                    {"expression": t.metadata["expression"]}))
    assert ok and int(text) == t.answer


def test_stepwise_tool_takes_one_operation():
    env = StepwiseCalculatorEnv()
    tool = env.tool("calculator")
    assert asyncio.run(run_tool(tool, {"expression": "6*7"})) == ("42", True)
    text, ok = asyncio.run(run_tool(tool, {"expression": "6*7+1"}))
    assert not ok and "at most 1" in text
    task = env.sample_tasks(1, seed=3)[0]
    assert task.answer == safe_eval(task.metadata["expression"])


def test_fixed_answer_width():
    env = CalculatorEnv(num_range=(10, 99), answer_digits=4)
    tasks = env.sample_tasks(50, seed=1)
    assert all(1000 <= t.answer <= 9999 for t in tasks)
    assert len({len(t.prompt) for t in tasks}) == 1


def test_verifier_parses_separators_and_integral_decimals():
    """Issue 20: "1,798" was read as 798 and "1798.0" as 0."""
    env = CalculatorEnv()
    t = env.sample_tasks(1, seed=0)[0]
    t.answer = 1798
    for good in ("The answer is 1,798.", "1798.0", "The answer is 1798.00", "= 1,798.0",
                 "The answer is 1798", "**1798**"):
        assert env.verify(t, good) == 1.0, good
    for bad in ("1798.5", "The answer is 1,797.", "798", "17,98", "no number", ""):
        assert env.verify(t, bad) == 0.0, bad
    t.answer = -1798
    assert env.verify(t, "It is -1,798.0.") == 1.0
    t.answer = 12
    assert env.verify(t, "Step 1: 3*4 = 12. So the answer is 12.") == 1.0
