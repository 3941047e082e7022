"""The subagent variant of the long-horizon job (issue 38): the main agent delegates.

A chain task ("Start at 512. Apply +37, 2 times.") under SubagentOrchestrator:
the main agent spawns `subagent:helper` with the task word for word
(`spawn_subagent`), the helper runs the calculator once per operation and
answers "The answer is V.", and the main agent answers with the helper's
number. The helper is the weak link: in half its demonstrations it answers
after its first call, with that call's result (it stops early), so most
failed attempts are helper failures. Each spawn is judged (`helper_ok`: the
helper's number is its sub-task's result) and recorded as a harness event,
as compactions record `memo_ok`.
"""

from __future__ import annotations

import json
import random
import re

from ac2_jax.envs import chain_policy
from ac2_jax.envs.calculator import last_integer, parse_chain_state, safe_eval
from ac2_jax.orchestration.default import SubagentOrchestrator
from experiments.calculator.long_horizon import count_main_requests

HELPER = "helper"
AGENT = f"subagent:{HELPER}"


def subtask_result(task_text: str) -> int | None:
    """The result of a chain task's text ("Start at V. Apply OP, N times."), else None."""
    state = parse_chain_state(task_text)
    if state is None:
        return None
    value, left, op = state
    return safe_eval(f"{value}{op * left}") if left else value


class JudgedSubagentOrchestrator(SubagentOrchestrator):
    """SubagentOrchestrator whose spawns are judged: after each, an event
    {"agent": "subagent:<name>", "kind": "subagent", "task", "answer", "helper_ok"}
    (helper_ok: the answer's last number is the sub-task's result; None when the
    sub-task is not a chain task)."""

    async def _spawn(self, name: str, task: str) -> str:
        answer = await super()._spawn(name, task)
        expected = subtask_result(task)
        ok = None if expected is None else last_integer(answer) == expected
        self.trace.events.append({"agent": f"subagent:{name}", "kind": "subagent",
                                  "task": task, "answer": answer, "helper_ok": ok})
        return answer


def subagent_factory(cfg, sampling: dict, max_steps: int):
    def make(env, task, client, model_name):
        return JudgedSubagentOrchestrator(env, task, client, model_name, max_steps=max_steps,
                                          sampling=dict(sampling))
    return make


def _call(name: str, arguments: dict, rng: random.Random) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{
        "id": f"call_{rng.randrange(10**6)}", "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)}}]}


def helper_policy(agent: str, messages: list[dict], rng: random.Random, *,
                  stop_early_prob: float) -> dict:
    """The scripted demonstrator. main: spawns the helper on its task word for word,
    then answers with the number the helper returned. helper: `chain_policy`'s main
    agent (one calculator call per operation, then "The answer is V."); with
    `stop_early_prob`, after a call it answers with that call's result instead of
    going on (drawn at each request that has a result and operations left)."""
    if agent == "main":
        results = [m for m in messages if m.get("role") == "tool"]
        if not results:
            task = next(m["content"] for m in messages if m.get("role") == "user")
            return _call("spawn_subagent", {"name": HELPER, "task": task}, rng)
        value = last_integer(results[-1].get("content"))
        return {"role": "assistant", "content": f"The answer is {value}."}
    reply = chain_policy("main", messages, rng)
    results = [m for m in messages if m.get("role") == "tool"]
    if reply.get("tool_calls") and results and rng.random() < stop_early_prob:
        return {"role": "assistant",
                "content": f"The answer is {last_integer(results[-1].get('content'))}."}
    return reply


def demo_policy(cfg, rng: random.Random):
    """policy(agent, messages, tools) of the variant's demonstrations."""
    p = cfg.demos.stop_early_prob
    return lambda agent, messages, tools: helper_policy(agent, messages, rng,
                                                        stop_early_prob=p)


_ANSWER_RE = re.compile(r"The answer is (\d+)")


def main_request_accuracy(traces, tokenizer) -> dict[str, dict[str, float]]:
    """Where the main agent slips: its first request must spawn the helper on the task
    word for word ("first_call"); each later request must answer with the helper's
    number ("answer": "The answer is V.", V the number of the helper's reply in the
    prompt; wrong when the helper gave none). Returns {kind: {"n", "correct", "rate"}}."""
    def judge(prompt, out, first):
        if first:
            task = re.findall(r"Start at \d+\. Apply [+-]\d+, \d+ times\.", prompt)
            return "first_call", (bool(task) and f'"task": "{task[-1]}"' in out
                                  and f'"name": "{HELPER}"' in out)
        got = _ANSWER_RE.findall(prompt)
        return "answer", bool(got) and f"The answer is {int(got[-1])}." in out
    return count_main_requests(traces, tokenizer, judge)
