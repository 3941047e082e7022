"""Coding: write a small Python function; hidden unit tests grade it.

Each task names a function and what it must do, with parameters drawn per task
(e.g. "clamp to [lo, hi]", "every k-th item", "the n-th Fibonacci number
mod m"). The agent may try code with the `run_tests` tool, which runs the
Its final answer is the code (optionally in a
```python block); the reward is the fraction of the hidden tests that pass,
run in a fresh sandboxed child process (`ac2_jax.envs.sandbox`: wall and CPU
time, memory), so code that loops forever or crashes scores 0.
"""

from __future__ import annotations

import random
import re

from ac2_jax.envs import Env, SandboxLimits, Task, Tool, run_sandboxed
from ac2_jax.seeds import hashed_seed
from examples._sync import run_sync
from examples.coding.checks import check, run_python

LIMITS = SandboxLimits(wall_s=10.0, cpu_s=5.0, memory_mb=512)


def _clamp(p):
    lo, hi = p["lo"], p["hi"]
    xs = [lo - 7, lo, (lo + hi) // 2, hi, hi + 3]
    return (
        f"Write `def clamp(x)` returning x limited to the range [{lo}, {hi}].",
        f"def clamp(x):\n    return max({lo}, min({hi}, x))\n",
        [f"assert clamp({x}) == {max(lo, min(hi, x))}" for x in xs],
        f"Use max({lo}, min({hi}, x)).",
    )


def _every_kth(p):
    k = p["k"]
    cases = [list(range(10)), [3, 1, 4, 1, 5, 9, 2, 6], [], ["a", "b", "c"]]
    return (
        f"Write `def every_kth(items)` returning every {k}-th item of the list, "
        "starting with the first.",
        f"def every_kth(items):\n    return items[::{k}]\n",
        [f"assert every_kth({c!r}) == {c[::k]!r}" for c in cases],
        f"A slice with step {k}: items[::{k}].",
    )


def _fib_mod(p):
    m = p["m"]

    def fib(n):
        a, b = 0, 1
        for _ in range(n):
            a, b = b, (a + b) % m
        return a

    return (
        f"Write `def fib_mod(n)` returning the n-th Fibonacci number (fib_mod(0) == 0, "
        f"fib_mod(1) == 1) modulo {m}.",
        f"def fib_mod(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
        f"        a, b = b, (a + b) % {m}\n    return a\n",
        [f"assert fib_mod({n}) == {fib(n)}" for n in (0, 1, 2, 10, 50)],
        f"Loop n times keeping (a, b) -> (b, (a + b) % {m}); start at (0, 1).",
    )


def _count_char(p):
    c = p["c"]
    words = ["banana", "", "abracadabra", "mississippi", "xyz"]
    return (
        f"Write `def count_char(s)` returning how many times {c!r} occurs in s.",
        f"def count_char(s):\n    return s.count({c!r})\n",
        [f"assert count_char({w!r}) == {w.count(c)}" for w in words],
        f"str.count: s.count({c!r}).",
    )


_FAMILIES = (
    ("clamp", _clamp, [{"lo": lo, "hi": lo + w} for lo in range(-5, 6) for w in (3, 10, 25)]),
    ("every_kth", _every_kth, [{"k": k} for k in range(2, 7)]),
    ("fib_mod", _fib_mod, [{"m": m} for m in (7, 10, 97, 1000, 10007)]),
    ("count_char", _count_char, [{"c": c} for c in "abisxy"]),
)


def extract_code(text: str | None) -> str:
    """The code of an answer: the last ```python (or bare ```) block, else the text."""
    if not text:
        return ""
    blocks = re.findall(r"```(?:python|py)?\s*\n(.*?)```", text, flags=re.S)
    return blocks[-1] if blocks else text


class CodingEnv(Env):
    """Small function-writing tasks with visible and hidden tests (see the module doc)."""

    name = "coding"
    system_prompt = (
        "You write small Python functions. Use the run_tests tool to try your code on the "
        "examples. Reply with the final code alone, in a ```python block."
    )

    def __init__(self, *, visible: int = 2):
        self.visible = visible
        self._instances = [(fam, make(p)) for fam, make, ps in _FAMILIES for p in ps]

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        # Split by instance: each instance belongs to one split (by its hash), never both.
        pool = (
            [
                i
                for i, (fam, inst) in enumerate(self._instances)
                if hashed_seed("coding-split", fam, inst[1]) % 4 != 0
            ]
            if split == "train"
            else [
                i
                for i, (fam, inst) in enumerate(self._instances)
                if hashed_seed("coding-split", fam, inst[1]) % 4 == 0
            ]
        )
        rng = random.Random(hashed_seed("coding", seed, split))
        picks = rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]
        tasks = []
        for j, i in enumerate(picks):
            fam, (prompt, solution, tests, hint) = self._instances[i]
            examples = "\n".join(t.removeprefix("assert ") for t in tests[: self.visible])
            tasks.append(
                Task(
                    task_id=f"{split}-{seed}-{j}-{fam}{i}",
                    prompt=f"{prompt}\nExamples:\n{examples}",
                    answer=solution,
                    domain=fam,
                    metadata={"tests": tests, "hint": hint},
                )
            )
        return tasks

    def _run(self, code: str, tests: list[str]) -> str:
        text, ok = run_sync(
            lambda: run_sandboxed(
                "run_tests", check, {"code": code, "tests": tests}, LIMITS, LIMITS.wall_s or 10.0
            )
        )
        return text if ok else f"passed 0/{len(tests)}\n{text}"

    @property
    def tools(self) -> list[Tool]:
        return [
            Tool(
                name="run_python",
                description="Runs Python code in a sandbox; returns what it prints (or the error).",
                parameters={
                    "type": "object",
                    "properties": {"code": {"type": "string"}},
                    "required": ["code"],
                },
                fn=run_python,
                timeout_s=10.0,
                sandbox=LIMITS,
            )
        ]

    def verify(self, task: Task, answer: str | None) -> float:
        code = extract_code(answer)
        if not code.strip():
            return 0.0
        tests = task.metadata["tests"]
        report = self._run(code, tests)
        m = re.match(r"passed (\d+)/(\d+)", report)
        return int(m.group(1)) / len(tests) if m else 0.0

    def reference_answer(self, task: Task) -> str:
        return f"```python\n{task.answer}```"

    def hint(self, task: Task) -> str:
        return task.metadata["hint"]

    def demonstration(self, task: Task) -> list[dict]:
        """Tries the solution on the examples with run_python, then answers with it."""
        code = task.answer + "".join(
            f"print({t.removeprefix('assert ').split(' == ')[0]})\n"
            for t in task.metadata["tests"][: self.visible]
        )
        result = run_python(code)
        call = {
            "id": "call_0",
            "type": "function",
            "function": {"name": "run_python", "arguments": _json({"code": code})},
        }
        return self.initial_messages(task) + [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": result},
            {"role": "assistant", "content": self.reference_answer(task)},
        ]


def _json(obj) -> str:
    import json

    return json.dumps(obj)
