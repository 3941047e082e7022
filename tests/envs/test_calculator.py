"""Calculator envs: safe evaluation, verifier, disjoint splits, the chain tasks and their memos."""

import asyncio

import pytest

from ac2_jax.envs import (
    CalculatorEnv,
    ChainCalculatorEnv,
    StepwiseCalculatorEnv,
    chain_memo,
    chain_policy,
    parse_chain_state,
    run_tool,
    safe_eval,
)


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


def test_chain_tasks_have_fixed_widths_and_disjoint_splits():
    env = ChainCalculatorEnv()
    train = env.sample_tasks(200, seed=0)
    assert train == env.sample_tasks(200, seed=0)
    evals = env.sample_tasks(200, seed=0, split="eval")
    assert not {t.prompt for t in train} & {t.prompt for t in evals}
    assert {len(t.metadata["ops"]) for t in train} == {3, 4, 5}
    # One width whatever the count: every number sits at a fixed offset.
    assert {len(t.prompt) for t in train} == {len("Start at 512. Apply +37, 4 times.")}
    for t in train:
        values = [t.metadata["start"]] + t.metadata["values"]
        assert all(100 <= v <= 999 for v in values), t.prompt
        op = t.metadata["op"]
        assert len(op) == 3 and op[0] in "+-" and set(t.metadata["ops"]) == {op}, t.prompt
        assert t.answer == values[-1] == safe_eval(t.metadata["expression"])
        assert parse_chain_state(t.prompt) == (t.metadata["start"], len(t.metadata["ops"]), op)
        assert env.verify(t, env.reference_answer(t)) == 1.0
    tool = env.tool("calculator")
    assert asyncio.run(run_tool(tool, {"expression": "512+37"})) == ("549", True)
    assert not asyncio.run(run_tool(tool, {"expression": "512+37-29"}))[1]
    with pytest.raises(ValueError, match="ops_range"):
        ChainCalculatorEnv(ops_range=(3, 12))


def test_chain_memo_judging():
    env = ChainCalculatorEnv()
    task = env.sample_tasks(1, seed=0)[0]
    history = [{"role": "user", "content": task.prompt},
               {"role": "assistant", "content": "", "tool_calls": []},
               {"role": "tool", "tool_call_id": "c", "content": "549"}]
    assert chain_memo(549, "+37", 3) == "Start at 549. Apply +37, 3 times."
    assert env.judge_memo(task, history, chain_memo(549, "+37", 3)) is True
    assert env.judge_memo(task, history, chain_memo(548, "+37", 3)) is False  # garbled value
    assert env.judge_memo(task, history, "Apply +37, 3 times.") is False     # dropped value
    assert env.judge_memo(task, history, "Start at 15490.") is False  # not a whole number
    assert env.judge_memo(task, history[:1], "549") is None  # no result yet: no verdict
    assert parse_chain_state("Progress so far: Start at 549. Apply +37, 3 times.") == (
        549, 3, "+37")
    assert parse_chain_state("Start at 565. Apply -12, 0 times.") == (565, 0, "-12")
    assert parse_chain_state("no state here") is None


def test_chain_policy_follows_the_memo_and_its_errors_propagate():
    import json
    import random
    rng = random.Random(0)
    task = "Start at 512. Apply -29, 3 times."
    main = [{"role": "system", "content": "s"}, {"role": "user", "content": task}]
    call = chain_policy("main", main, rng)["tool_calls"][0]["function"]
    assert json.loads(call["arguments"]) == {"expression": "512-29"}
    # After a compaction the main agent sees the task, then the memo: the memo, not the
    # task, says where things stand; the operation comes from the task.
    restart = main + [{"role": "user", "content": "Progress so far: Start at 483. Apply -29, 2 times."}]
    call = chain_policy("main", restart, rng)["tool_calls"][0]["function"]
    assert json.loads(call["arguments"]) == {"expression": "483-29"}
    done = main + [{"role": "user", "content": "Progress so far: Start at 425. Apply -29, 0 times."}]
    assert chain_policy("main", done, rng)["content"] == "The answer is 425."
    # The compactor copies the latest tool result and counts down from the memo ...
    transcript = (f"user: {task}\nuser: Progress so far: Start at 483. Apply -29, 2 times.\n"
                  'assistant: [call calculator({"expression": "483-29"})]\ntool: 454\n\nSummarize')
    request = [{"role": "system", "content": "c"}, {"role": "user", "content": transcript}]
    assert chain_policy("compactor", request, rng)["content"] == "Start at 454. Apply -29, 1 times."
    # ... or from the task at the first compaction.
    first = (f"user: {task}\n"
             'assistant: [call calculator({"expression": "512-29"})]\ntool: 483\n\nSummarize')
    request1 = [{"role": "system", "content": "c"}, {"role": "user", "content": first}]
    assert chain_policy("compactor", request1, rng)["content"] == "Start at 483. Apply -29, 2 times."
    garbled = [chain_policy("compactor", request, rng, memo_error_prob=1.0)["content"]
               for _ in range(20)]
    assert all(m.endswith(". Apply -29, 1 times.") and m != "Start at 454. Apply -29, 1 times."
               and len(m) == len(task) for m in garbled)


def test_chain_policy_stale_memo_keeps_the_value_before_the_latest_result():
    import random
    rng = random.Random(0)
    task = "Start at 512. Apply -29, 3 times."
    transcript = (f"user: {task}\nuser: Progress so far: Start at 483. Apply -29, 2 times.\n"
                  'assistant: [call calculator({"expression": "483-29"})]\ntool: 454\n\nSummarize')
    request = [{"role": "system", "content": "c"}, {"role": "user", "content": transcript}]
    # The count goes down, the value does not: 483 is the memo's value before the call.
    stale = chain_policy("compactor", request, rng, memo_error_prob=1.0, memo_error="stale")
    assert stale["content"] == "Start at 483. Apply -29, 1 times."
    first = (f"user: {task}\n"
             'assistant: [call calculator({"expression": "512-29"})]\ntool: 483\n\nSummarize')
    stale1 = chain_policy("compactor", [{"role": "user", "content": first}], rng,
                          memo_error_prob=1.0, memo_error="stale")
    assert stale1["content"] == "Start at 512. Apply -29, 2 times."
    env = ChainCalculatorEnv()
    history = [{"role": "user", "content": task}, {"role": "tool", "content": "483"}]
    assert env.judge_memo(None, history, stale1["content"]) is False
    # Without errors the mode changes nothing; an unknown mode is refused by name.
    assert chain_policy("compactor", request, rng, memo_error="stale")["content"] == (
        "Start at 454. Apply -29, 1 times.")
    with pytest.raises(ValueError, match="memo_error"):
        chain_policy("compactor", request, rng, memo_error="drop")


def test_chain_env_signs():
    plus = ChainCalculatorEnv(signs="+").sample_tasks(100, seed=0)
    assert {t.metadata["op"][0] for t in plus} == {"+"}
    both = ChainCalculatorEnv().sample_tasks(100, seed=0)
    assert {t.metadata["op"][0] for t in both} == {"+", "-"}
    with pytest.raises(ValueError, match="signs"):
        ChainCalculatorEnv(signs="*")
