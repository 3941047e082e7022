"""The demo environment: arithmetic tasks with a calculator tool.

`CalculatorEnv` asks "What is 47*38+12?"; the `calculator` tool evaluates an
arithmetic expression; the verifier checks the last number of the answer
exactly ("1,798" and "1798.0" read as 1798). `StepwiseCalculatorEnv` is the
harder variant: its tool takes one operation at a time (`a op b`), so a task
needs several calls, and a small context budget makes compaction kick in.
`ChainCalculatorEnv` is the long-horizon one ("Start at 512. Apply +37, 4
times."): one call per operation, and under a CompactionOrchestrator that
restarts the main agent from the memo alone, the memo must carry the running
value (`judge_memo`); `chain_policy` is its scripted, imperfect demonstrator.
"""

from __future__ import annotations

import ast
import json
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

    def __init__(
        self,
        num_range: tuple[int, int] = (2, 99),
        templates=("{a}*{b}+{c}",),
        answer_digits: int | None = None,
    ):
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
        tasks: list[Task] = []
        while len(tasks) < n:
            expr = self._expression(rng)
            if sum(map(ord, expr)) % 2 != want:
                continue
            if self.answer_digits and len(str(abs(safe_eval(expr)))) != self.answer_digits:
                continue
            tasks.append(
                Task(
                    task_id=f"{self.name}-{split}-{seed}-{len(tasks)}",
                    prompt=f"What is {expr}?",
                    answer=safe_eval(expr),
                    domain=self.name,
                    metadata={"expression": expr},
                )
            )
        return tasks

    @property
    def tools(self) -> list[Tool]:
        return [
            Tool(
                name="calculator",
                description="Evaluate an integer arithmetic expression (+ - * and parentheses).",
                parameters={
                    "type": "object",
                    "properties": {"expression": {"type": "string"}},
                    "required": ["expression"],
                },
                fn=lambda expression: str(safe_eval(expression, self.max_ops_per_call)),
                timeout_s=5.0,
            )
        ]

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


def demonstration(
    env: CalculatorEnv, task: Task, rng: random.Random, skip_tool_prob: float = 0.5
) -> list[dict]:
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
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculator", "arguments": f'{{"expression": "{expr}"}}'},
    }
    return msgs + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": str(task.answer)},
        {"role": "assistant", "content": f"The answer is {task.answer}."},
    ]


# The long-horizon task: one operation applied n times, "Start at 512. Apply +37, 4 times.",
# and its state as a memo in the same words, the task that is left: "Start at 549. Apply
# +37, 3 times." Both have a fixed width whatever n is (3-digit values, a 2-digit operand,
# one-digit counts) and the main agent always reads the latest state from its last message,
# so every number a model copies (value and operation from that message, the latest tool
# result for the compactor) sits at the same offset from where it is written in every
# episode: a tiny model learns such copies fast (it did not learn content-addressed ones).
_TASK_RE = re.compile(r"\s*Start at (\d+)\. Apply ([+-]\d+), (\d+) times\.\s*$")
PROGRESS_PREFIX = "Progress so far: "  # how CompactionOrchestrator hands the memo to the main agent


def _chain_task_prompt(start: int, op: str, count: int) -> str:
    """The prompt of a chain task: apply `op` ("+37") `count` times, starting at `start`."""
    return f"Start at {start}. Apply {op}, {count} times."


def chain_memo(value: int, op: str, left: int) -> str:
    """The memo of a chain task's state: the task that is left, in the task's words."""
    return _chain_task_prompt(value, op, left)


def parse_chain_state(text: str) -> tuple[int, int, str] | None:
    """(value, operations left, operation) from a task prompt or a memo (with or
    without the "Progress so far: " prefix); None when it is neither."""
    text = (text or "").strip()
    if text.startswith(PROGRESS_PREFIX.strip()):
        text = text[len(PROGRESS_PREFIX.strip()) :]
    m = _TASK_RE.match(text)
    if m:
        return int(m.group(1)), int(m.group(3)), m.group(2)
    return None


class ChainCalculatorEnv(StepwiseCalculatorEnv):
    """Long-horizon tasks: one addition or subtraction applied `ops_range` times.

    "Start at 512. Apply +37, 4 times." with every running value in
    `value_range` (3 digits) and the operand in `operand_range` (2 digits),
    rejection-sampled, so the prompt has a fixed width whatever the count;
    `signs` are the operations drawn from ("+-", or "+" alone). The
    tool does one operation per call, so a task needs one call per operation.
    Train and eval tasks come from disjoint halves of the prompt space (hash
    parity).
    """

    name = "chain_calculator"

    def __init__(
        self,
        ops_range: tuple[int, int] = (3, 5),
        value_range: tuple[int, int] = (100, 999),
        operand_range: tuple[int, int] = (10, 99),
        signs: str = "+-",
    ):
        super().__init__()
        if not signs or set(signs) - set("+-"):
            raise ValueError(f'ChainCalculatorEnv: signs must be "+", "-" or "+-", got {signs!r}')
        if not 1 <= ops_range[0] <= ops_range[1] <= 9:
            raise ValueError(
                f"ChainCalculatorEnv: ops_range must be (lo, hi) with "
                f"1 <= lo <= hi <= 9 (one-digit counts), got {ops_range}"
            )
        self.ops_range, self.value_range = tuple(ops_range), tuple(value_range)
        self.operand_range, self.signs = tuple(operand_range), signs

    def _chain(self, rng: random.Random) -> tuple[int, str, list[int]]:
        lo, hi = self.value_range
        while True:
            value = start = rng.randint(lo, hi)
            op = f"{rng.choice(self.signs)}{rng.randint(*self.operand_range)}"
            values = []
            for _ in range(rng.randint(*self.ops_range)):
                value = safe_eval(f"{value}{op}")
                values.append(value)
            if all(lo <= v <= hi for v in values):
                return start, op, values

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        want = 0 if split == "train" else 1
        rng = random.Random(f"{self.name}:{split}:{seed}")
        tasks: list[Task] = []
        while len(tasks) < n:
            start, op, values = self._chain(rng)
            prompt = _chain_task_prompt(start, op, len(values))
            if sum(map(ord, prompt)) % 2 != want:
                continue
            ops = [op] * len(values)
            tasks.append(
                Task(
                    task_id=f"{self.name}-{split}-{seed}-{len(tasks)}",
                    prompt=prompt,
                    answer=values[-1],
                    domain=self.name,
                    metadata={
                        "expression": f"{start}{''.join(ops)}",
                        "start": start,
                        "op": op,
                        "ops": ops,
                        "values": values,
                    },
                )
            )
        return tasks

    def judge_memo(self, task: Task, messages: list[dict], memo: str) -> bool | None:
        """True when the memo carries the latest tool result as a whole number (the
        value the next operation starts from); None before any tool result."""
        results = [m for m in messages if m.get("role") == "tool"]
        if not results:
            return None
        needed = (results[-1].get("content") or "").strip()
        return needed in re.findall(r"\d+", memo or "")


def _garble(value: int, rng: random.Random) -> int:
    """`value` with one digit changed (same width, never equal to `value`)."""
    digits = list(str(value))
    i = rng.randrange(len(digits))
    choices = [d for d in "0123456789" if d != digits[i] and not (i == 0 and d == "0")]
    digits[i] = rng.choice(choices)
    return int("".join(digits))


def _chain_state(texts: list[tuple[str, str]]) -> tuple[int, int, str] | None:
    """The state after `texts` ((role, text) in order): (value, operations left,
    operation) of the latest memo (else the task), advanced by one operation per
    tool result after it (value: the latest result). The task is shown before a
    memo; it does not reset the state."""
    state, from_memo = None, False
    for role, text in texts:
        parsed = parse_chain_state(text) if role == "user" else None
        is_memo = text.strip().startswith(PROGRESS_PREFIX.strip())
        if parsed is not None and (is_memo or not from_memo):
            state, from_memo = parsed, is_memo
        elif role == "tool" and state is not None:
            value = last_integer(text)
            if value is not None:
                state = (value, max(state[1] - 1, 0), state[2])
    return state


def chain_policy(
    agent: str,
    messages: list[dict],
    rng: random.Random,
    *,
    memo_error_prob: float = 0.0,
    main_slip_prob: float = 0.0,
    memo_error: str = "garble",
) -> dict:
    """The scripted demonstrator of ChainCalculatorEnv under compaction: the
    assistant message it sends for one request of `agent` ("main" or "compactor").

    main: from the latest "Progress so far:" memo (else the task) and any tool
    result after it, calls the calculator on "<value><op>", or answers "The answer is
    <value>." when no operation is left; with `main_slip_prob` one digit of the
    value is wrong (the error then propagates). compactor: reads the
    orchestrator's transcript ("role: text" lines, calls as "[call ...]") and
    writes `chain_memo` of the state (the latest tool result, the operation,
    the count left);
    with `memo_error_prob` the memo's value is wrong, so the main agent,
    restarting from the memo, goes wrong: `memo_error` "garble" changes one
    digit; "stale" keeps the value from before the latest tool result (the
    count still goes down), the update a careless summary drops.
    """
    if memo_error not in ("garble", "stale"):
        raise ValueError(
            f'chain_policy: memo_error must be "garble" or "stale", got {memo_error!r}'
        )
    if agent == "compactor":
        lines = (messages[-1].get("content") or "").splitlines()
        texts = [(r, t) for r, t in (line.split(": ", 1) for line in lines if ": " in line)]
        state = _chain_state(texts)
        if state is None:
            return {"role": "assistant", "content": "No progress yet."}
        value, left, op = state
        if rng.random() < memo_error_prob:
            if memo_error == "stale":
                results = [i for i, (r, _) in enumerate(texts) if r == "tool"]
                before = _chain_state(texts[: results[-1]]) if results else None
                value = before[0] if before is not None else value
            else:
                value = _garble(value, rng)
        return {"role": "assistant", "content": chain_memo(value, op, left)}
    state = _chain_state([(m["role"], m.get("content") or "") for m in messages])
    if state is None:
        return {"role": "assistant", "content": "I cannot tell where the task stands."}
    value, left, op = state
    if left <= 0:
        return {"role": "assistant", "content": f"The answer is {value}."}
    if rng.random() < main_slip_prob:
        value = _garble(value, rng)
    args = json.dumps({"expression": f"{value}{op}"})
    call = {
        "id": f"call_{rng.randrange(10**6)}",
        "type": "function",
        "function": {"name": "calculator", "arguments": args},
    }
    return {"role": "assistant", "content": "", "tool_calls": [call]}
