"""The demo environment: arithmetic tasks with a calculator tool.

`CalculatorEnv` asks "What is 47*38+12?"; the `calculator` tool evaluates an
arithmetic expression; the verifier checks the last number of the answer
exactly ("1,798" and "1798.0" read as 1798). `StepwiseCalculatorEnv` is the
harder variant: its tool takes one operation at a time (`a op b`), so a task
needs several calls, and a small context budget makes compaction kick in.
"""

from __future__ import annotations

import ast
import operator
import random
import re

from ac2_jax.envs.base import Env, Task, Tool

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
# A number: optional sign, digits with or without thousands separators ("1,798"),
# optional decimal part ("1798.0"). Grouped form needs exactly 3 digits per group.
_NUM_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def safe_eval(expression: str, max_ops: int | None = None) -> int:
    """Evaluates an integer expression of + - * and parentheses, nothing else."""
    if len(expression) > 200:
        raise ValueError("expression too long")
    tree = ast.parse(expression.strip(), mode="eval")
    count = 0

    def ev(node):
        nonlocal count
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            count += 1
            if max_ops is not None and count > max_ops:
                raise ValueError(f"at most {max_ops} operation(s) per call")
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported expression element: {ast.dump(node)[:40]}")

    return ev(tree.body)


def last_integer(text: str | None) -> int | None:
    """The last number in `text` as an int: "1,798" and "1798.0" give 1798.

    None when there is no number or the last one is not an integer ("1798.5").
    """
    found = _NUM_RE.findall(text or "")
    if not found:
        return None
    number = found[-1].replace(",", "")
    whole, _, frac = number.partition(".")
    if frac.strip("0"):
        return None
    return int(whole)


class CalculatorEnv(Env):
    """a*b+c style tasks; reward 1 for the exact result, else 0."""

    name = "calculator"
    system_prompt = "Use the calculator tool, then give the answer."
    max_ops_per_call: int | None = None

    def __init__(self, num_range: tuple[int, int] = (2, 99), templates=("{a}*{b}+{c}",),
                 answer_digits: int | None = None):
        self.num_range = num_range
        self.templates = tuple(templates)
        # Fixed-width numbers and answers give every task the same token layout
        # (a tiny model then copies digits by relative position, which it learns fast).
        self.answer_digits = answer_digits

    def _expression(self, rng: random.Random) -> str:
        lo, hi = self.num_range
        tpl = rng.choice(self.templates)
        return tpl.format(**{k: rng.randint(lo, hi) for k in "abcd"})

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        # Train and eval draw from disjoint halves of the expression space
        # (parity of a hash of the expression), so held-out tasks are unseen.
        want = 0 if split == "train" else 1
        rng = random.Random(f"{self.name}:{split}:{seed}")
        tasks = []
        while len(tasks) < n:
            expr = self._expression(rng)
            if sum(map(ord, expr)) % 2 != want:
                continue
            if self.answer_digits and len(str(abs(safe_eval(expr)))) != self.answer_digits:
                continue
            tasks.append(Task(task_id=f"{self.name}-{split}-{seed}-{len(tasks)}",
                              prompt=f"What is {expr}?", answer=safe_eval(expr),
                              domain=self.name, metadata={"expression": expr}))
        return tasks

    @property
    def tools(self) -> list[Tool]:
        return [Tool(
            name="calculator",
            description="Evaluate an integer arithmetic expression (+ - * and parentheses).",
            parameters={"type": "object", "properties": {"expression": {"type": "string"}},
                        "required": ["expression"]},
            fn=lambda expression: str(safe_eval(expression, self.max_ops_per_call)),
            timeout_s=5.0)]

    def verify(self, task: Task, answer: str | None) -> float:
        return float(last_integer(answer) == task.answer)

    def reference_answer(self, task: Task) -> str:
        return f"The answer is {safe_eval(task.metadata['expression'])}."


class StepwiseCalculatorEnv(CalculatorEnv):
    """Harder: the tool does one operation per call, tasks need several."""

    name = "stepwise_calculator"
    system_prompt = "Use the calculator for one operation at a time, then give the answer."
    max_ops_per_call = 1

    def __init__(self, num_range=(2, 30), templates=("({a}*{b}+{c})*{d}", "{a}*{b}+{c}*{d}")):
        super().__init__(num_range, templates)


def demonstration(env: CalculatorEnv, task: Task, rng: random.Random,
                  skip_tool_prob: float = 0.5) -> list[dict]:
    """A synthetic demo conversation for SFT warm starts, deliberately imperfect.

    With probability `skip_tool_prob` the demo answers without the tool and
    guesses (a near miss, so usually wrong); otherwise it calls the calculator
    with the task's expression and reports the result. A model fit to these
    starts well under 100% and RL can improve it by calling the tool.
    """
    expr = task.metadata["expression"]
    msgs = env.initial_messages(task)
    if rng.random() < skip_tool_prob:
        guess = task.answer + rng.choice([-1, 1]) * rng.randint(1, 30)
        return msgs + [{"role": "assistant", "content": f"The answer is {guess}."}]
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": f'{{"expression": "{expr}"}}'}}
    return msgs + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": str(task.answer)},
        {"role": "assistant", "content": f"The answer is {task.answer}."},
    ]
