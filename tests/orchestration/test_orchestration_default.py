"""Orchestrators through the real endpoint (FastAPI over HTTP, JaxSampler, tiny model).

The tiny model is fitted to scripted conversations (tests/support/serving_helpers.py: the
tool loop, a delegation and a transient-message script), so greedy decoding
takes the paths each orchestrator must handle. Episodes are recorded by the
endpoint; each orchestrator must yield the episode structure of its shape.
"""

import asyncio
import json
import os
import subprocess
import sys
import textwrap

import httpx
import openai
import pytest

from ac2_jax.envs import Task
from ac2_jax.orchestration import (
    CompactionOrchestrator,
    DefaultOrchestrator,
    LifecycleClient,
    MultiResponseOrchestrator,
    SubagentOrchestrator,
    run_rollout,
)
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.serving.app import build_app
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from tests.support.serving_helpers import (
    DELEGATE,
    REMINDER,
    SYSTEM,
    TOOLS,
    USER,
    AddEnv,
    fit_tiny_model,
)

ADMIN = "sk-admin-orch"
GREEDY = {"temperature": 0, "max_tokens": 64}


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("orch")
    tok = build_tiny_tokenizer(str(tmp / "tok"))
    model = fit_tiny_model(tok)  # also fitted to the delegation and transient scripts
    sampler = JaxSampler(model, max_context=768, max_batch=8, min_batch=8, min_cache_len=768,
                         prefill_chunk=64, eos_token_ids=tok.stop_token_ids, tokenizer=tok, seed=0)
    app = build_app(sampler, tok, admin_key=ADMIN, model_name="tiny",
                    trace_store=str(tmp / "traces.jsonl"))
    url, stop = serve_in_thread(app)
    yield dict(url=url, env=AddEnv(), tok=tok)
    stop()
    sampler.close()


def run(endpoint, make, task=None):
    async def go():
        lc = LifecycleClient(endpoint["url"], ADMIN)
        try:
            t = task or endpoint["env"].sample_tasks(1, 0)[0]
            return await run_rollout(lc, endpoint["env"], t, make, "tiny")
        finally:
            await lc.aclose()
    return asyncio.run(go())


def test_tool_loop_is_one_main_episode_with_metrics(endpoint):
    trace, conv = run(endpoint, lambda e, t, c, m: DefaultOrchestrator(e, t, c, m, sampling=GREEDY))
    assert conv.status == "finished" and "17" in conv.answer
    assert trace.reward == 1.0 and trace.status == "finished"
    assert [e.agent for e in trace.episodes] == ["main"]
    assert len(trace.episodes[0].completions) == 3
    m = conv.metrics
    assert m["steps"] == 3 and m["tool_calls"] == 2 and m["tool_errors"] == 0
    outputs = sum(len(c.output_ids) for c in trace.episodes[0].completions)
    assert m["output_tokens"] == outputs and m["prompt_tokens"] > 3 * 100
    assert m["wall_time_s"] > 0 and "cached_tokens" in m
    assert trace.metrics["steps"] == 3  # merged into the lifecycle trace


def test_compaction_starts_new_main_episode_after_compactor(endpoint):
    orchs = []

    def make(e, t, c, m):
        orchs.append(CompactionOrchestrator(e, t, c, m, context_budget=50, max_steps=3,
                                            sampling=GREEDY))
        return orchs[-1]

    trace, conv = run(endpoint, make)
    agents = [e.agent for e in trace.episodes]
    assert agents[:3] == ["main", "compactor", "main"], agents
    assert orchs[0].compactions >= 1
    restarted = endpoint["tok"].decode(trace.episodes[2].token_ids)
    assert "Progress so far:" in restarted
    # Compactor tokens are agent tokens and are trained too.
    assert trace.episodes[1].num_agent_tokens > 0


def test_subagent_gets_its_own_labelled_episode(endpoint):
    task = Task(task_id="delegate", prompt=DELEGATE, answer=17)
    trace, conv = run(endpoint, lambda e, t, c, m: SubagentOrchestrator(e, t, c, m,
                                                                         sampling=GREEDY), task)
    agents = [e.agent for e in trace.episodes]
    assert agents == ["main", "subagent:helper"], agents
    assert len(trace.episodes[1].completions) == 3  # the subagent ran the tool loop
    assert "17" in conv.answer and conv.metrics["tool_calls"] == 3  # 1 spawn + 2 adds


def test_multi_response_branches(endpoint):
    orchs = []

    def make(e, t, c, m):
        orchs.append(MultiResponseOrchestrator(e, t, c, m, n=2, sampling=GREEDY))
        return orchs[-1]

    trace, conv = run(endpoint, make)
    steps = conv.metrics["steps"]
    assert all(len(r) == 2 for r in orchs[0].collected)
    # n responses to one prompt are n branches. Greedy makes both responses
    # identical, so the next request extends both branches: each of the two
    # episodes gets one completion per request.
    assert [e.agent for e in trace.episodes] == ["main", "main"]
    assert [len(e.completions) for e in trace.episodes] == [steps, steps]
    assert trace.episodes[0].token_ids == trace.episodes[1].token_ids


def test_transient_message_starts_a_new_episode(endpoint):
    def make(e, t, c, m):
        return DefaultOrchestrator(e, t, c, m, sampling=GREEDY,
                                   transient=lambda step, msgs: [REMINDER] if step == 1 else None)

    trace, conv = run(endpoint, make)
    assert conv.status == "finished" and "17" in conv.answer
    assert [e.agent for e in trace.episodes] == ["main", "main"]
    # The reminder was shown once and never kept in the history.
    assert not any(m.get("content") == REMINDER["content"] for m in conv.messages)
    assert REMINDER["content"] in endpoint["tok"].decode(trace.episodes[0].token_ids)


HARNESS = textwrap.dedent('''
    import json, os, sys
    from openai import OpenAI
    client = OpenAI()  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
    tools = json.loads(os.environ["TOOLS"])
    messages = json.loads(os.environ["MESSAGES"])
    for _ in range(4):
        msg = client.chat.completions.create(model="tiny", messages=messages, tools=tools,
                                             temperature=0, max_tokens=64).choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            args = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": str(args["a"] + args["b"])})
    print(json.dumps({"answer": msg.content,
                      "imports_ac2_jax": any(m.startswith("ac2_jax") for m in sys.modules)}))
''')


@pytest.mark.full  # the harness is a child process
def test_harness_with_only_the_openai_client(endpoint, tmp_path):
    admin = httpx.Client(base_url=endpoint["url"], headers={"Authorization": f"Bearer {ADMIN}"})
    info = admin.post("/v1/rollouts", json={"task_id": "harness"}).json()
    script_path = tmp_path / "harness.py"
    script_path.write_text(HARNESS)
    env = {**os.environ, "OPENAI_BASE_URL": info["base_url"], "OPENAI_API_KEY": info["api_key"],
           "TOOLS": json.dumps(TOOLS), "MESSAGES": json.dumps([SYSTEM, USER])}
    out = subprocess.run([sys.executable, str(script_path)], env=env, capture_output=True,
                         text=True, timeout=300, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["imports_ac2_jax"] is False and "17" in result["answer"]
    done = admin.post(f"/v1/rollouts/{info['rollout_id']}/finish", json={"reward": 1.0})
    assert done.status_code == 200, done.text
    trace = admin.get(f"/v1/rollouts/{info['rollout_id']}/trace").json()
    trace = trace.get("trace", trace)
    assert trace["reward"] == 1.0 and len(trace["episodes"]) == 1
    assert len(trace["episodes"][0]["completions"]) == 3
    admin.close()
    assert openai  # the harness used the same client library


# ------------------------------------------------------------ budgets and format errors
# Issue 20. A: per-agent step budgets. B: context / generated-token bounds.
# C: malformed or truncated tool calls are answered with an error, not taken as the answer.

def test_subagent_steps_do_not_use_the_main_step_budget(endpoint):
    task = Task(task_id="delegate-budget", prompt=DELEGATE, answer=17)
    trace, conv = run(endpoint, lambda e, t, c, m: SubagentOrchestrator(
        e, t, c, m, max_steps=2, subagent_max_steps=3, sampling=GREEDY), task)
    # The main agent made 2 requests (spawn, answer); the subagent its own 3.
    assert conv.status == "finished" and "17" in conv.answer, conv.status
    assert conv.metrics["steps_by_agent"] == {"main": 2, "subagent:helper": 3}
    assert conv.metrics["steps"] == 5  # the total stays
    assert trace.metrics["steps_by_agent"] == {"main": 2, "subagent:helper": 3}


def test_subagent_step_budget_defaults_to_max_steps():
    env = AddEnv()
    orch = SubagentOrchestrator(env, env.sample_tasks(1, 0)[0], None, "tiny", max_steps=7)
    assert orch.subagent_max_steps == 7


class ScriptedClient:
    """An AsyncOpenAI stand-in: answers requests from a script as real openai ChatCompletions.

    Each script item is (content, finish_reason, prompt_tokens, completion_tokens)."""

    def __init__(self, items):
        self.items, self.requests, self.params = list(items), [], []
        self.chat = self
        self.completions = self

    async def create(self, *, model, messages, **kw):
        self.requests.append([dict(m) for m in messages])
        self.params.append(kw)
        content, finish, prompt, out = self.items.pop(0)
        calls = None
        for prefix, tool in (("CALL ", "add"), ("SPAWN ", "spawn_subagent")):
            if content.startswith(prefix):
                calls = [{"id": f"call_{len(self.requests)}", "type": "function",
                          "function": {"name": tool, "arguments": content[len(prefix):]}}]
                content = None
                break
        return openai.types.chat.ChatCompletion.model_validate({
            "id": "x", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "finish_reason": finish, "logprobs": None,
                         "message": {"role": "assistant", "content": content,
                                     "tool_calls": calls}}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": out,
                      "total_tokens": prompt + out}})


def run_scripted(items, orchestrator=None, **kw):
    env = AddEnv()
    client = ScriptedClient(items)
    orch = (orchestrator or DefaultOrchestrator)(env, env.sample_tasks(1, 0)[0], client, "tiny",
                                                 **kw)
    from ac2_jax.orchestration.base import SingleTaskUser, run_task
    return asyncio.run(run_task(orch, SingleTaskUser())), client


ADD34 = ("CALL " + json.dumps({"a": 3, "b": 4}), "tool_calls")
ADD710 = ("CALL " + json.dumps({"a": 7, "b": 10}), "tool_calls")
ANSWER = ("The answer is 17.", "stop")


def test_context_bound_is_per_request_not_a_sum():
    # Three requests of 100 + 10 tokens: the sum (330) is past 150, no request is.
    conv, _ = run_scripted([(*ADD34, 100, 10), (*ADD710, 100, 10), (*ANSWER, 100, 10)],
                           max_context_tokens=150)
    assert conv.status == "finished" and "17" in conv.answer
    assert conv.metrics["max_context_tokens"] == 110


def test_context_bound_stops_at_a_request_past_it():
    conv, client = run_scripted([(*ADD34, 100, 10), (*ADD710, 200, 10), (*ANSWER, 100, 10)],
                                max_context_tokens=150)
    assert conv.status == "token_limit" and len(client.requests) == 2


def test_generated_tokens_bound():
    conv, client = run_scripted([(*ADD34, 100, 10), (*ADD710, 100, 10), (*ANSWER, 100, 10)],
                                max_generated_tokens=15)
    assert conv.status == "token_limit" and len(client.requests) == 2


def test_old_max_total_tokens_name_is_a_clear_error():
    env = AddEnv()
    with pytest.raises(TypeError, match="max_context_tokens.*max_generated_tokens"):
        DefaultOrchestrator(env, env.sample_tasks(1, 0)[0], None, "tiny", max_total_tokens=100)


@pytest.mark.parametrize("bad,finish,what", [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": }}\n</tool_call>', "stop", "JSON"),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 3', "length", "truncated"),
])
def test_malformed_tool_call_is_answered_with_an_error(bad, finish, what):
    conv, client = run_scripted([(bad, finish, 50, 10), (*ADD34, 50, 10), (*ADD710, 50, 10),
                                 (*ANSWER, 50, 10)])
    assert conv.status == "finished" and "17" in conv.answer
    assert conv.metrics["tool_format_errors"] == 1 and conv.metrics["tool_calls"] == 2
    feedback = client.requests[1][-1]
    assert feedback["role"] == "user" and feedback["content"].startswith("error:")
    assert what in feedback["content"] and "<tool_call>" in feedback["content"]


def test_malformed_tool_calls_are_bounded_by_the_step_budget():
    bad = ('<tool_call>{"name": add}</tool_call>', "stop", 50, 10)
    conv, client = run_scripted([bad] * 3, max_steps=3)
    assert conv.status == "step_limit" and conv.answer is None
    assert conv.metrics["tool_format_errors"] == 3 and len(client.requests) == 3


class AgentClient(ScriptedClient):
    """ScriptedClient with one script per agent label (X-Agent); records (agent, messages)."""

    def __init__(self, by_agent):
        super().__init__([])
        self.by_agent = {a: list(items) for a, items in by_agent.items()}
        self.calls = []

    async def create(self, *, model, messages, extra_headers=None, **kw):
        agent = (extra_headers or {}).get("X-Agent", "main")
        self.calls.append((agent, [dict(m) for m in messages]))
        self.items = [self.by_agent[agent].pop(0)]
        return await super().create(model=model, messages=messages, **kw)


def run_compaction(by_agent, user=None, **kw):
    from ac2_jax.orchestration.base import SingleTaskUser, run_task
    env = AddEnv()
    client = AgentClient(by_agent)
    orch = CompactionOrchestrator(env, env.sample_tasks(1, 0)[0], client, "tiny", **kw)
    return asyncio.run(run_task(orch, user or SingleTaskUser())), client, orch


MEMO = ("memo: 3 + 4 was added.", "stop")


def test_compaction_keeps_the_latest_tool_exchange_for_the_main_agent():
    # The first request (90 + 20) is past the budget: the compactor runs before the
    # next main request, and that request still shows the tool call and its result.
    conv, client, orch = run_compaction(
        {"main": [(*ADD34, 90, 20), (*ADD710, 60, 10), (*ANSWER, 80, 10)],
         "compactor": [(*MEMO, 50, 10)]}, context_budget=100, sampling=GREEDY)
    assert conv.status == "finished" and "17" in conv.answer, conv.events
    assert [a for a, _ in client.calls] == ["main", "compactor", "main", "main"]
    after = client.calls[2][1]
    assert after[0] == {"role": "system", "content": AddEnv.system_prompt}
    assert any("Progress so far:" in (m.get("content") or "") and "memo: 3 + 4" in m["content"]
               for m in after)
    assert {"role": "user", "content": USER["content"]} in after  # the turn's input, verbatim
    assert after[-2]["role"] == "assistant" and after[-2]["tool_calls"]
    assert after[-1]["role"] == "tool" and after[-1]["content"] == "7"
    assert orch.compactions == 1


def test_compactor_is_its_own_agent_with_its_own_system_prompt():
    conv, client, orch = run_compaction(
        {"main": [(*ADD34, 90, 20), (*ADD710, 60, 10), (*ANSWER, 80, 10)],
         "compactor": [(*MEMO, 50, 10)]}, context_budget=100)
    agent, request = client.calls[1]
    assert agent == "compactor"
    assert request[0]["role"] == "system"
    assert request[0]["content"] == CompactionOrchestrator.COMPACTOR_SYSTEM_PROMPT
    assert request[0]["content"] != AddEnv.system_prompt
    assert not any(m["role"] == "system" and m["content"] == AddEnv.system_prompt for m in request)
    assert conv.metrics["steps_by_agent"]["compactor"] == 1


def test_too_large_task_ends_after_the_compaction_cap():
    # Every main request is past the budget however much is compacted.
    conv, client, orch = run_compaction(
        {"main": [(*ADD34, 500, 10)] * 8, "compactor": [(*MEMO, 50, 10)] * 8},
        context_budget=100, max_steps=8, max_consecutive_compactions=2)
    assert conv.status == "agent_error", conv.status
    assert orch.compactions <= 2
    assert conv.metrics["steps_by_agent"]["main"] < 8
    reasons = [e["reason"] for e in conv.events if e.get("kind") == "compaction_error"]
    assert reasons and "compaction" in reasons[0]


def test_compaction_at_a_turn_boundary_keeps_the_new_user_turn():
    from ac2_jax.orchestration.base import ScriptedUser
    second = "Now add 1 and 2."
    conv, client, orch = run_compaction(
        {"main": [(*ANSWER, 90, 20), ("3", "stop", 40, 5)], "compactor": [(*MEMO, 50, 10)]},
        user=ScriptedUser([USER["content"], second]), context_budget=100)
    assert [a for a, _ in client.calls] == ["main", "compactor", "main"]
    after = client.calls[2][1]
    assert after[-1] == {"role": "user", "content": second}
    assert conv.status == "finished" and conv.answer == "3"


def test_compaction_that_does_not_shrink_the_context_is_an_agent_error():
    conv, client, orch = run_compaction(
        {"main": [(*ADD34, 90, 20), (*ADD710, 115, 5), (*ANSWER, 80, 10)],
         "compactor": [(*MEMO, 50, 10)]}, context_budget=100, max_consecutive_compactions=5)
    assert conv.status == "agent_error" and orch.compactions == 1
    reasons = [e["reason"] for e in conv.events if e.get("kind") == "compaction_error"]
    assert reasons and "did not shrink" in reasons[0]


def test_one_call_per_episode_compacts_after_every_tool_result():
    # Each prompt fits the budget; prompt + output + the tool result does not, so the
    # agent is compacted after every call. Its prompts shrink against the context they
    # replace (95 < 110, 95 < 115): no "did not shrink" error for its own output.
    conv, client, orch = run_compaction(
        {"main": [(*ADD34, 90, 20), (*ADD710, 95, 20), (*ANSWER, 95, 10)],
         "compactor": [(*MEMO, 50, 10)] * 2}, context_budget=100, max_consecutive_compactions=1)
    assert conv.status == "finished", conv.events
    assert [a for a, _ in client.calls] == ["main", "compactor", "main", "compactor", "main"]
    assert orch.compactions == 2


class JudgingAddEnv(AddEnv):
    """AddEnv whose memos are judged: a memo must carry the latest tool result."""

    def judge_memo(self, task, messages, memo):
        results = [m["content"] for m in messages if m["role"] == "tool"]
        return None if not results else results[-1] in memo


def test_compaction_without_the_exchange_restarts_from_system_turn_and_memo():
    """keep_exchange=False (the long-horizon main job): the memo is all that is left."""
    from ac2_jax.orchestration.base import SingleTaskUser, run_task
    env = JudgingAddEnv()
    client = AgentClient({"main": [(*ADD34, 90, 20), (*ADD710, 60, 10), (*ANSWER, 80, 10)],
                          "compactor": [(*MEMO, 50, 10)]})
    orch = CompactionOrchestrator(env, env.sample_tasks(1, 0)[0], client, "tiny",
                                  context_budget=100, keep_exchange=False)
    conv = asyncio.run(run_task(orch, SingleTaskUser()))
    assert conv.status == "finished"
    after = client.calls[2][1]
    assert after == [{"role": "system", "content": AddEnv.system_prompt},
                     {"role": "user", "content": USER["content"]},
                     {"role": "user", "content": "Progress so far: memo: 3 + 4 was added."}]
    event = next(e for e in conv.events if e["kind"] == "compaction")
    assert event["memo"] == MEMO[0] and event["memo_ok"] is False  # "7" is not in the memo


def test_memo_prefix_and_compactor_sampling():
    """memo_prefix="" hands the memo over in its own words; compactor_sampling changes
    the compactor's requests only (here its temperature), on top of `sampling`."""
    from ac2_jax.orchestration.base import SingleTaskUser, run_task

    class KwClient(AgentClient):
        async def create(self, *, model, messages, extra_headers=None, **kw):
            self.calls_kw = getattr(self, "calls_kw", []) + [
                ((extra_headers or {}).get("X-Agent"), kw.get("temperature"), kw.get("seed"))]
            return await super().create(model=model, messages=messages,
                                        extra_headers=extra_headers, **kw)

    env = JudgingAddEnv()
    client = KwClient({"main": [(*ADD34, 90, 20), (*ADD710, 60, 10), (*ANSWER, 80, 10)],
                       "compactor": [(*MEMO, 50, 10)]})
    orch = CompactionOrchestrator(env, env.sample_tasks(1, 0)[0], client, "tiny",
                                  context_budget=100, keep_exchange=False, memo_prefix="",
                                  sampling={"temperature": 0.3, "seed": 7},
                                  compactor_sampling={"temperature": 1.0})
    conv = asyncio.run(run_task(orch, SingleTaskUser()))
    assert conv.status == "finished"
    assert client.calls[2][1][-1] == {"role": "user", "content": MEMO[0]}
    temps = [(agent, t) for agent, t, _ in client.calls_kw]
    assert temps == [("main", 0.3), ("compactor", 1.0), ("main", 0.3), ("main", 0.3)]
    assert all(seed is not None for *_, seed in client.calls_kw)  # still seeded per request


def test_memo_ok_is_recorded_when_the_env_judges_and_absent_when_it_cannot():
    from ac2_jax.orchestration.base import SingleTaskUser, run_task
    good = ("memo: added 3 + 4 = 7.", "stop")
    for env, want in ((JudgingAddEnv(), True), (AddEnv(), None)):
        client = AgentClient({"main": [(*ADD34, 90, 20), (*ADD710, 60, 10), (*ANSWER, 80, 10)],
                              "compactor": [(*good, 50, 10)]})
        orch = CompactionOrchestrator(env, env.sample_tasks(1, 0)[0], client, "tiny",
                                      context_budget=100)
        conv = asyncio.run(run_task(orch, SingleTaskUser()))
        event = next(e for e in conv.events if e["kind"] == "compaction")
        assert event.get("memo_ok") is want
    # The exchange is kept by default (the existing behaviour).
    assert client.calls[2][1][-1] == {"role": "tool", "tool_call_id": "call_1", "content": "7"}


def test_a_seeded_attempt_gives_every_request_its_own_seed():
    """Main, subagent and answer requests of one attempt seeded 7: four different seeds
    (one seed on every request would correlate their sampling: test_orchestration_base)."""
    spawn = ("SPAWN " + json.dumps({"name": "helper", "task": "Add 3 and 4."}), "tool_calls")
    items = [(*spawn, 50, 10), (*ADD34, 50, 10), ("7", "stop", 50, 2), (*ANSWER, 60, 5)]
    conv, client = run_scripted(items, orchestrator=SubagentOrchestrator,
                                sampling={"seed": 7, "temperature": 0.5})
    assert conv.status == "finished" and conv.metrics["steps_by_agent"] == {
        "main": 2, "subagent:helper": 2}
    seeds = [p["seed"] for p in client.params]
    assert seeds[0] == 7 and len(set(seeds)) == 4, seeds
    assert all(p["temperature"] == 0.5 for p in client.params)
    _, again = run_scripted(items, orchestrator=SubagentOrchestrator,
                            sampling={"seed": 7, "temperature": 0.5})
    assert [p["seed"] for p in again.params] == seeds  # reproducible
    _, unseeded = run_scripted(items, orchestrator=SubagentOrchestrator)
    assert all("seed" not in p for p in unseeded.params)  # no seed: the sampler draws one
