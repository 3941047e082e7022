"""The long-horizon main job (issue 18) at toy size: demonstrations recorded
through the real CompactionOrchestrator fit the config's context budget, and
multi-episode traces (main, compactor, main, ...) collected through the real
endpoint reach the RL batch with the compactor's tokens trained.

The policy behind the endpoint is `PolicySampler`: a Sampler (token ids in,
token ids out) that decodes the prompt and answers with the env's scripted
demonstrator, because an untrained tiny model never calls the tool and a
trained one takes minutes. Everything after it (endpoint, orchestrator,
episodes, rewards, batch) is the real path.
"""

import asyncio
import copy
import dataclasses
import itertools
import json
import random
import re

import numpy as np
import pytest

from ac2_jax.envs import chain_policy
from ac2_jax.evals import evaluate
from ac2_jax.orchestration import CompactionOrchestrator, LifecycleClient
from ac2_jax.sampling.base import SampleResult
from ac2_jax.serving.app import build_app
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.trace import TraceStore
from ac2_jax.training.rl import BatchConfig, build_batch
from ac2_jax.training.rl.trainer import EndpointCollector
from experiments.calculator import agent as calculator_agent
from experiments.calculator import long_horizon
from experiments.calculator.config import get_config

ADMIN = "sk-admin-long"
_TURN = re.compile(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", re.S)
_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.S)
_STORES = itertools.count()


class PolicySampler:
    """A Sampler whose policy is `chain_policy` on the decoded prompt. A compactor
    prompt seen for the n-th time gets a garbled memo when n is odd, so the
    attempts of one task differ in outcome the same way whatever their order."""

    def __init__(self, tokenizer, max_context: int = 1024):
        self.tok, self.max_context, self.policy_version = tokenizer, max_context, 0
        self.seen: dict[str, int] = {}

    def load_weights(self, step=None):
        return self.policy_version

    def forget(self):
        """Start counting prompts afresh, so a collection's outcomes do not depend
        on which tests (or retries) showed the same compactor prompts before."""
        self.seen.clear()

    def _messages(self, text: str) -> list[dict]:
        out = []
        for role, body in _TURN.findall(text):
            responses = _RESPONSE.findall(body) if role == "user" else []
            out += ([{"role": "tool", "content": r} for r in responses] if responses
                    else [{"role": role, "content": body}])
        return out

    async def generate(self, prompt_ids, params, *, on_tokens=None):
        text = self.tok.decode(list(prompt_ids))
        messages = self._messages(text)
        agent = ("compactor" if CompactionOrchestrator.COMPACTOR_SYSTEM_PROMPT in text
                 else "main")
        n = self.seen[text] = self.seen.get(text, -1) + 1
        reply = chain_policy(agent, messages, random.Random(0),
                             memo_error_prob=float(agent == "compactor" and n % 2 == 1))
        out = reply.get("content") or ""
        for c in reply.get("tool_calls") or []:
            f = c["function"]
            out += ('<tool_call>\n{"name": "' + f["name"] + '", "arguments": '
                    + f["arguments"] + '}\n</tool_call>')
        ids = self.tok.encode(out) + [self.tok.eos_token_id]
        return SampleResult(ids, [-0.25] * len(ids), "stop", self.policy_version)


@pytest.fixture(scope="module")
def long_setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("long")
    cfg = get_config("long")
    env = calculator_agent.build_env(cfg)
    tok = calculator_agent.build_tokenizer(cfg, str(tmp / "tok"), env)
    return dict(cfg=cfg, env=env, tok=tok, tmp=tmp)


@pytest.fixture(scope="module")
def served(long_setup):
    tok = long_setup["tok"]
    policy = PolicySampler(tok)
    app = build_app(policy, tok, admin_key=ADMIN, model_name="policy")
    url, stop = serve_in_thread(app)
    yield dict(long_setup, url=url, policy=policy)
    stop()


def _perfect():
    rng = random.Random(0)
    return lambda agent, messages, tools: chain_policy(agent, messages, rng)


def _make(cfg, budget=None):
    if budget is not None:
        cfg = cfg.copy_and_resolve_references()
        cfg.harness.context_budget = budget
    return calculator_agent.orchestrator_factory({"temperature": 0.3, "max_tokens": 48},
                                                 cfg.rollout.max_steps, cfg)


def test_demonstrations_need_compaction_under_the_configured_budget(long_setup):
    cfg, env, tok = long_setup["cfg"], long_setup["env"], long_setup["tok"]
    tasks = env.sample_tasks(60, seed=5)
    demos = long_horizon.record_demos(env, tasks, tok, _make(cfg), _perfect())
    for t, (conv, requests) in zip(tasks, demos):
        assert conv.status == "finished" and env.verify(t, conv.answer) == 1.0, conv.events
        memos = [e for e in conv.events if e["kind"] == "compaction"]
        # One call per main episode: a compaction after every tool result.
        assert len(memos) == len(t.metadata["ops"]) and all(e["memo_ok"] for e in memos)
        agents = [a for a, *_ in requests]
        assert agents.count("main") == len(t.metadata["ops"]) + 1
        assert agents.count("compactor") == len(memos)
        # After a compaction the main agent sees system + task + memo only.
        restart = requests[agents.index("compactor") + 1][1]
        assert [m["role"] for m in restart] == ["system", "user", "user"]
        assert restart[1]["content"] == t.prompt
        assert restart[2]["content"].startswith("Progress so far: ")
    # Without compaction even the shortest task's pattern passes the budget.
    shortest = min(tasks, key=lambda t: len(t.metadata["ops"]))
    assert len(shortest.metadata["ops"]) == cfg.env.ops_range[0]
    [(conv, _)] = long_horizon.record_demos(env, [shortest], tok, _make(cfg, budget=10**6),
                                            _perfect())
    assert not [e for e in conv.events if e["kind"] == "compaction"]
    assert conv.metrics["max_context_tokens"] > cfg.harness.context_budget


def test_demo_segments_train_main_and_compactor_outputs(long_setup):
    cfg, env, tok = long_setup["cfg"], long_setup["env"], long_setup["tok"]
    cfg = cfg.copy_and_resolve_references()
    cfg.demos.memo_error_prob = 0.5
    tasks = env.sample_tasks(12, seed=6)
    policy = long_horizon.compaction_policy(cfg, random.Random(0))
    segments, stats = long_horizon.long_demo_segments(env, tasks, tok, _make(cfg), policy,
                                                      log=lambda *a: None)
    assert stats["segments"]["compactor"] == stats["judged"] > 0
    assert stats["segments"]["main"] == stats["judged"] + len(tasks)  # one per main episode
    assert 0 < stats["judged_ok"] < stats["judged"]   # some memos were garbled
    assert stats["passed"] < stats["demos"]         # and those attempts failed
    texts = [tok.decode(s.tokens.tolist()) for s in segments]
    compactor = [s for s, x in zip(segments, texts) if "<tools>" not in x]
    # Each segment carries the label of the agent that speaks in it.
    assert [s.agent for s in segments] == ["main" if "<tools>" in x else "compactor"
                                           for x in texts]
    text = tok.decode(compactor[0].tokens.tolist())
    assert CompactionOrchestrator.COMPACTOR_SYSTEM_PROMPT in text and "<tools>" not in text
    trained = tok.decode(compactor[0].tokens[compactor[0].loss_mask > 0].tolist())
    assert re.fullmatch(r"Start at \d{3}\. Apply [+-]\d{2}, \d times\.<\|im_end\|>",
                        trained), trained
    # One call per main episode: each main segment trains one call, or the answer.
    main = [s for s, x in zip(segments, texts) if "<tools>" in x]
    calls = [tok.decode(s.tokens[s.loss_mask > 0].tolist()).count('"expression"') for s in main]
    assert set(calls) == {0, 1} and calls.count(0) == len(tasks)


def _collect(served, tasks_per_step=2, attempts=4):
    """One fresh collection: its own store (a store that already holds step 0's
    attempts is resumed from, which handed one test another test's traces, and
    which of those were garbled depended on timing) and a fresh prompt count."""
    served["policy"].forget()
    store = TraceStore(str(served["tmp"] / f"rollouts-{next(_STORES)}.jsonl"))

    async def go():
        lc = LifecycleClient(served["url"], ADMIN)
        try:
            collector = EndpointCollector(
                lc, served["env"], _make(served["cfg"]), "policy",
                store, tasks_per_step=tasks_per_step,
                attempts_per_task=attempts, seed=3, concurrency=8)
            return await collector.collect(0)
        finally:
            await lc.aclose()
    return asyncio.run(go())


def _trained_tokens(batch) -> float:
    return float((batch.loss_mask * batch.loss_weight * (batch.features["advantages"] != 0)).sum())


def test_multi_episode_traces_reach_the_batch_with_compactor_tokens_trained(served):
    traces = _collect(served)
    assert len(traces) == 8
    for t in traces:
        agents = [e.agent for e in t.episodes]
        assert agents.count("main") >= 2 and agents.count("compactor") >= 1, agents
        assert agents[:3] == ["main", "compactor", "main"]
        events = t.metadata["artifacts"]["events"]
        assert [e["kind"] for e in events].count("compaction") == agents.count("compactor")
        assert all(isinstance(e["memo_ok"], bool) for e in events if e["kind"] == "compaction")
    assert {t.reward for t in traces} == {0.0, 1.0}  # garbled memos failed their attempts
    config = BatchConfig(seq_len=512, rows=8, layout="tree", task_capacity=8,
                         segment_capacity=64)
    batch, stats, adv = build_batch(traces, 0, config)
    assert stats.truncated_segments == 0 and np.abs(adv).sum() > 0
    main_only = [dataclasses.replace(t, episodes=[e for e in t.episodes if e.agent == "main"])
                 for t in traces]
    without, _, _ = build_batch(main_only, 0, config)
    compactor_tokens = sum(e.num_agent_tokens for t, a in zip(traces, adv) if a != 0
                           for e in t.episodes if e.agent == "compactor")
    assert compactor_tokens > 0
    # Every agent token of every episode is in the loss, the compactor's included.
    assert _trained_tokens(batch) == _trained_tokens(without) + compactor_tokens
    if "train_agents" in {f.name for f in dataclasses.fields(BatchConfig)}:
        only_main, _, _ = build_batch(traces, 0, dataclasses.replace(config,
                                                                    train_agents=("main",)))
        assert _trained_tokens(only_main) == _trained_tokens(without)


def test_eval_reports_per_agent_figures(served):
    env = served["env"]
    tasks = env.sample_tasks(6, seed=0, split="eval")

    async def go():
        lc = LifecycleClient(served["url"], ADMIN)
        try:
            return await evaluate(lc, env, tasks, _make(served["cfg"]), "policy", k=2, seed=None)
        finally:
            await lc.aclose()
    result = asyncio.run(go())
    figures = long_horizon.agent_figures(result)
    judged = [e["memo_ok"] for tr in result.traces
              for e in tr.metadata["artifacts"]["events"] if "memo_ok" in e]
    fidelity = figures["memo_fidelity"]
    assert figures["memos_judged"] == len(judged) > 0
    assert fidelity["mean"] == pytest.approx(
        np.mean([np.mean([e["memo_ok"] for e in tr.metadata["artifacts"]["events"]
                          if "memo_ok" in e])
                 for tr in result.traces]), abs=0.25)  # per-task means, not pooled
    assert 0 <= fidelity["low"] <= fidelity["mean"] <= fidelity["high"] <= 1
    assert figures["compactions_per_attempt"] >= 1
    assert figures["episodes_per_trace"] == pytest.approx(
        np.mean([len(t.episodes) for t in result.traces]))
    by_agent = figures["episodes_per_trace_by_agent"]
    assert by_agent["main"] >= 2 and by_agent["compactor"] >= 1
    assert json.loads(json.dumps(figures)) == figures
    same = long_horizon.memo_fidelity_difference(result, result)
    assert same.mean == 0.0


def test_main_request_accuracy_counts_each_slip_where_it_happens(served):
    tok = served["tok"]
    traces = _collect(served, tasks_per_step=2, attempts=2)
    acc = long_horizon.main_request_accuracy(traces, tok)
    mains = sum(len(e.completions) for t in traces for e in t.episodes if e.agent == "main")
    assert sum(v["n"] for v in acc.values()) == mains
    assert acc["first_call"]["n"] == len(traces) and acc["answer"]["n"] == len(traces)
    # The scripted policy follows what it is shown, garbled memos included: every
    # main request is right given its prompt, though some attempts fail.
    assert all(v["rate"] == 1.0 for v in acc.values()) and "no_state" not in acc
    assert {t.reward for t in traces} == {0.0, 1.0}
    # One miscopied first call and one wrong answer are counted where they happen.
    first = traces[0].episodes[0].completions[0]
    last = [c for e in traces[1].episodes if e.agent == "main" for c in e.completions][-1]
    bad = copy.deepcopy(traces)
    bad[0].episodes[0].completions[0].output_ids = tok.encode(
        tok.decode(list(first.output_ids)).replace('"expression": "', '"expression": "9', 1))
    [c for e in bad[1].episodes if e.agent == "main" for c in e.completions][-1].output_ids = \
        tok.encode(tok.decode(list(last.output_ids)).replace("is ", "is 1", 1))
    worse = long_horizon.main_request_accuracy(bad, tok)
    assert worse["first_call"]["correct"] == acc["first_call"]["correct"] - 1
    assert worse["answer"]["correct"] == acc["answer"]["correct"] - 1
    assert worse["later_call"] == acc["later_call"]
