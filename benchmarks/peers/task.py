"""The loop race's agent task, shared by every system (stdlib only: each peer's venv imports it).

An attempt is the calculator tool loop of `ac2_jax.envs.CalculatorEnv` with its
turns fixed: system prompt + task, then `turns` assistant turns; after every
turn but the last the calculator's answer to the task's expression comes back
as a tool message, and the last turn is the final answer. The benchmark's
checkpoint has random weights, which never write a parseable tool call, so the
harness of every system makes the call itself after each non-final turn (a
"forced" tool call: same messages, same tokens, for every system) instead of
parsing one. Assistant turns are `max_tokens` long in every system: the
checkpoint keeps stop tokens (and every token that is not plain printable
ASCII) unsampleable (see bench_loop_race.write_checkpoint), so no system needs
an ignore-eos switch, and the equal-work check counts the tokens anyway.

The reward is the calculator verifier (1 for the exact result, the last
integer of the final answer) plus a small shaping term that tells random-weight
attempts apart (0.001 x the characters of the final answer, at most 0.5):
with the verifier alone every random attempt scores 0, every group ties, and
a GRPO step would train nothing (this library skips such an update).
"""

from __future__ import annotations

import json
import re

_NUM_RE = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")


def last_integer(text: str | None) -> int | None:
    """The last number of `text` as an int (as ac2_jax.envs.calculator.last_integer)."""
    found = _NUM_RE.findall(text or "")
    if not found:
        return None
    whole, _, frac = found[-1].replace(",", "").partition(".")
    return None if frac.strip("0") else int(whole)


def reward(answer: str | None, target: int) -> float:
    """Verifier (exact last integer) + 0.001 x characters of the answer (at most 0.5)."""
    return float(last_integer(answer) == target) + min(0.5, 0.001 * len(answer or ""))


def tool_message(task: dict) -> dict:
    """The calculator's answer to the task's expression, as the chat's tool message."""
    return {"role": "tool", "content": str(task["answer"])}


def first_messages(spec: dict, task: dict) -> list[dict]:
    """System prompt (with the tool's description) and the task."""
    return [{"role": "system", "content": spec["system_prompt"]},
            {"role": "user", "content": task["prompt"]}]


def load_spec(path: str) -> dict:
    """The race's spec (written by bench_loop_race): checkpoint, tasks, sizes, settings."""
    with open(path) as f:
        return json.load(f)


def peak_rss_mb() -> float:
    """This process's peak resident set (MB), from /proc (ru_maxrss would count children)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
