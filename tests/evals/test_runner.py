"""evaluate() through the real endpoint (FastAPI over HTTP, JaxSampler, tiny fitted model).

The model is fitted to the scripted 3-turn add-tool conversation
(tests/support/serving_helpers.py), so greedy attempts call the tool twice and
answer 17: tasks expecting 17 pass, tasks expecting another number fail.
"""

import asyncio
import dataclasses
import json

import pytest

from ac2_jax.envs import Env, Task, Tool
from ac2_jax.evals import TokenPrices, compare_results, evaluate, token_cost, trace_tokens
from ac2_jax.orchestration import DefaultOrchestrator, LifecycleClient
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.serving.app import build_app
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from tests.support.serving_helpers import SYSTEM, TOOLS, USER, fit_tiny_model

ADMIN = "sk-admin-evals"
PRICES = TokenPrices(0.20, 2.00, 8.00)


class AddEnv(Env):
    system_prompt = SYSTEM["content"]

    def sample_tasks(self, n, seed, split="train"):
        raise NotImplementedError("the tests list their tasks")

    @property
    def tools(self):
        fn = TOOLS[0]["function"]
        return [Tool(fn["name"], fn["description"], fn["parameters"],
                     lambda a, b: str(a + b))]

    def verify(self, task, answer):
        return float(answer is not None and str(task.answer) in answer)


def tasks():
    return [Task("ok-0", USER["content"], 17, domain="right"),
            Task("ok-1", USER["content"], 17, domain="right"),
            Task("bad-0", USER["content"], 99, domain="wrong")]


def factory(sampling, crash=()):
    """DefaultOrchestrator; `crash`: task ids whose harness dies (our fault, infra_error)."""
    def make(env, task, client, model):
        if task.task_id in crash:
            raise RuntimeError("sandbox died")
        return DefaultOrchestrator(env, task, client, model, max_steps=4, sampling=dict(sampling))
    return make


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evals")
    tok = build_tiny_tokenizer(str(tmp / "tok"))
    # The serving modules' sampler shape (test_messages, test_responses): their compiled
    # prefill and decode programs are the run's persistent-cache hits here.
    sampler = JaxSampler(fit_tiny_model(tok), max_context=512, max_batch=4, min_batch=4,
                         min_cache_len=512, prefill_chunk=32, min_prefill_rows=4,
                         eos_token_ids=tok.stop_token_ids, tokenizer=tok, seed=0)
    url, stop = serve_in_thread(build_app(sampler, tok, admin_key=ADMIN, model_name="tiny"))
    yield url
    stop()
    sampler.close()


def run_eval(url, task_list, make, **kw):
    async def go():
        lc = LifecycleClient(url, ADMIN)
        try:
            return await evaluate(lc, AddEnv(), task_list, make, "tiny", **kw)
        finally:
            await lc.aclose()
    return asyncio.run(go())


def test_k_attempts_summarised_per_task_domain_and_run(endpoint):
    seen = []
    res = run_eval(endpoint, tasks(), factory({"temperature": 0, "max_tokens": 48}), k=2,
                   prices=PRICES, name="greedy", on_attempt=seen.append)
    assert len(res.attempts) == len(seen) == 6 and res.k == 2
    assert [(a.task_id, a.attempt) for a in res.attempts] == [
        (t, a) for t in ("ok-0", "ok-1", "bad-0") for a in (0, 1)]
    assert len({a.seed for a in res.attempts}) == 6
    assert len({t.group_id for t in res.traces}) == 6
    assert [a.passed for a in res.attempts] == [True] * 4 + [False] * 2
    s = res.summary()
    o = s["overall"]
    assert o["pass_rate"].method == "clustered-t" and o["pass_rate"].mean == pytest.approx(2 / 3)
    assert s["per_domain"]["right"]["pass_rate"].mean == 1.0
    assert s["per_domain"]["wrong"]["pass_rate"].mean == 0.0
    assert o["pass_at_k"]["2"].mean == pytest.approx(2 / 3) and list(o["pass_at_k"]) == ["1", "2"]
    assert o["failures"]["finished"] == 6 and o["excluded_infra_errors"] == 0
    # The scripted policy: two tool calls, three requests in one append-only episode.
    assert o["process"]["tool_calls"].mean == 2 and o["process"]["steps"].mean == 3
    assert o["process"]["requests"].mean == 3 and o["process"]["episodes"].mean == 1
    for a, tr in zip(res.attempts, res.traces):
        # Token counts from the endpoint's trace equal the usage the client was sent.
        assert a.metrics["prompt_tokens"] == tr.metrics["prompt_tokens"]
        assert a.metrics["output_tokens"] == tr.metrics["output_tokens"]
        assert a.metrics["cached_tokens"] == tr.metrics["cached_tokens"]
        # Append-only: each later prompt starts with all of the previous prompt + output.
        comps = tr.episodes[0].completions
        assert a.prefix.reusable_tokens == sum(len(c.prompt_ids) + len(c.output_ids)
                                               for c in comps[:-1])
    p = o["prefix"]
    assert p.requests == 18 and 0.5 < p.to_dict()["reusable_share"] < 1.0
    tok = [trace_tokens(t) for t in res.traces]
    assert o["cost"].total == token_cost(sum(t["cached_tokens"] for t in tok),
                                         sum(t["uncached_tokens"] for t in tok),
                                         sum(t["output_tokens"] for t in tok), PRICES).total
    d = json.loads(json.dumps(res.to_dict(), allow_nan=False))
    assert d["n"] == 3 and d["summary"]["per_task"]["bad-0"]["passes"] == 0
    assert len(d["attempts"]) == 6 and d["pass_rate_ci95"][0] <= d["pass_rate"]


def test_same_seed_pairs_runs_and_infra_errors_are_counted(endpoint):
    sampling = {"temperature": 1.0, "max_tokens": 48, "seed": 123}  # evaluate's seeds override
    make = factory(sampling, crash=("bad-0",))
    a = run_eval(endpoint, tasks(), make, k=2, seed=5, infra_retries=1, name="a")
    b = run_eval(endpoint, tasks(), make, k=2, seed=5, name="b")
    outs = [[c.output_ids for e in t.episodes for c in e.completions] for t in a.traces]
    assert outs == [[c.output_ids for e in t.episodes for c in e.completions] for t in b.traces]
    assert [t.metadata["seed"] for t in a.traces] == [r.seed for r in a.attempts]
    crashed = [r for r in a.attempts if r.task_id == "bad-0"]
    assert all(r.status == "infra_error" and not r.scored and r.infra_retries == 1
               and "sandbox died" in r.error for r in crashed)
    o = a.summary()["overall"]
    assert o["excluded_infra_errors"] == 2 and o["infra_retries"] == 2 and o["tasks_scored"] == 2
    assert o["failures"]["infra_error"] == 2
    cmp = compare_results(b, a)
    assert cmp.estimate.mean == 0.0 and cmp.tasks_paired == 2 and cmp.tasks_dropped == ["bad-0"]
    with pytest.raises(ValueError, match="no scored attempt"):
        _ = a.rewards
    # (infra_error="fail" scoring is tested on records in test_summary.py.)
    other = dataclasses.replace(a, task_ids=a.task_ids[:2], attempts=a.attempts[:4])
    with pytest.raises(ValueError, match="different tasks"):
        compare_results(other, a)
    reseeded = dataclasses.replace(b, attempts=[dataclasses.replace(r, seed=r.seed + 1)
                                                for r in b.attempts])
    with pytest.raises(ValueError, match="different seeds"):
        compare_results(reseeded, a)


def test_bad_arguments_fail_before_any_rollout(endpoint):
    make = factory({"temperature": 0})
    with pytest.raises(ValueError, match="unique"):
        run_eval(endpoint, tasks()[:1] * 2, make)
    with pytest.raises(ValueError, match="k \\(attempts"):
        run_eval(endpoint, tasks(), make, k=0)
    with pytest.raises(ValueError, match="infra_error"):
        run_eval(endpoint, tasks(), make, infra_error="zero")
