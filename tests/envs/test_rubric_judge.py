"""Rubric-judge rewards (envs.RubricJudge, envs.JudgedEnv) through the library's own endpoint.

Two real endpoints (FastAPI over HTTP, `build_app` + `serve_in_thread`): the policy,
a scripted sampler answering "Paris" to even tasks and "Lyon" to odd ones; and the
judge, a scripted sampler that reads the answer out of the judge's prompt and replies
{"score": 1} for "Paris", {"score": 0} otherwise; slow (past the judge's timeout) or
garbled (not JSON) in the failure tests. The official openai client asks the judge.
Checked: scores and rewards, the content-hash cache (the judge endpoint is asked
once per distinct answer), retries with backoff and fed-back invalid replies, and a
judge that times out: JudgeUnavailable, the rollout ends infra_error with no reward,
counted (judge stats, the RL batch's infra_errors) and never trained (select_traces
keeps none of them).
"""

from __future__ import annotations

import asyncio
import re

import pytest

from ac2_jax.envs import (
    Env,
    JudgedEnv,
    JudgeUnavailable,
    RubricJudge,
    Task,
    check_env,
    parse_score_reply,
)
from ac2_jax.orchestration.rollouts import LifecycleClient, run_rollout
from ac2_jax.recipes.common import harness_factory
from ac2_jax.sampling.base import SampleResult
from ac2_jax.serving.app import build_app
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.training.rl.data import BatchConfig, select_traces

ADMIN = "admin-key"
RUBRIC = "Full marks only for naming the capital of France correctly."
_ANSWER = re.compile(r"## Answer\n(.*?)\n\n## Rubric", re.S)


class _Scripted:
    """What build_app needs of a Sampler; `reply(text)` gives the output text."""

    max_context = 4096
    policy_version = 0

    def __init__(self, tok, delay_s: float = 0.0):
        self.tok, self.delay_s, self.calls = tok, delay_s, 0

    def load_weights(self, step=None):
        return self.policy_version

    async def generate(self, prompt_ids, params, *, on_tokens=None):
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        ids = self.tok.encode(self.reply(self.tok.decode(list(prompt_ids)))) + [
            self.tok.eos_token_id]
        return SampleResult(ids, [-0.5] * len(ids), "stop", self.policy_version)


class PolicySampler(_Scripted):
    def reply(self, text):
        i = int(re.findall(r"France\? \((\d+)\)", text)[-1])
        return "Paris" if i % 2 == 0 else "Lyon"


class JudgeSampler(_Scripted):
    def reply(self, text):
        return '{"score": 1}' if "Paris" in _ANSWER.search(text).group(1) else '{"score": 0}'


class GarbledJudge(_Scripted):
    def reply(self, text):
        return "The answer looks fine to me."


class CapitalEnv(Env):
    name = "capital"

    def sample_tasks(self, n, seed, split="train"):
        return [Task(f"{split}-{seed}-{i}", f"What is the capital of France? ({i})", "Paris")
                for i in range(n)]

    def verify(self, task, answer):
        return float(answer == task.answer)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = build_tiny_tokenizer(str(tmp_path_factory.mktemp("judge") / "tok"))
    samplers = {"policy": PolicySampler(tok), "judge": JudgeSampler(tok),
                "slow": JudgeSampler(tok, delay_s=2.0), "garbled": GarbledJudge(tok)}
    urls, stops = {}, []
    for name, sampler in samplers.items():
        url, stop = serve_in_thread(build_app(sampler, tok, admin_key=ADMIN, model_name=name))
        urls[name] = url
        stops.append(stop)
    yield urls, samplers
    for stop in stops:
        stop()


def _judge(urls, name, **kw):
    return RubricJudge(RUBRIC, name, base_url=urls[name] + "/v1", api_key=ADMIN, **kw)


def test_the_judge_scores_through_the_library_endpoint_and_caches(served):
    urls, samplers = served
    judge = _judge(urls, "judge")
    before = samplers["judge"].calls
    q = "What is the capital of France?"
    assert judge.score(q, "Paris") == 1.0 and judge.score(q, "Lyon") == 0.0
    assert judge.score(q, "Paris") == 1.0  # same content: the cache, no request
    assert asyncio.run(judge.ascore(q, "Lyon")) == 0.0
    assert samplers["judge"].calls - before == 2
    assert judge.stats["requests"] == 2 and judge.stats["cache_hits"] == 2
    assert judge.stats["scored"] == 4 and judge.stats["unavailable"] == 0
    assert judge.key(q, "Paris") != judge.key(q, "Paris ")  # content, exactly


def _rollouts(urls, env, n):
    async def go():
        lifecycle = LifecycleClient(urls["policy"], ADMIN)
        make = harness_factory({"temperature": 0.0, "max_tokens": 8}, max_steps=1)
        tasks = env.sample_tasks(n, seed=0)
        out = await asyncio.gather(*(run_rollout(lifecycle, env, t, make, "policy", attempt=0)
                                     for t in tasks))
        return [trace for trace, _ in out]
    return asyncio.run(go())


def test_judged_rollouts_get_the_judges_reward(served):
    urls, _ = served
    judge = _judge(urls, "judge")
    env = JudgedEnv(CapitalEnv(), judge)
    traces = _rollouts(urls, env, 4)
    assert [t.status for t in traces] == ["finished"] * 4
    assert [t.reward for t in traces] == [1.0, 0.0, 1.0, 0.0]  # Paris for even tasks
    assert judge.stats["requests"] == 4 and judge.stats["cache_hits"] == 0
    again = _rollouts(urls, env, 4)  # the same attempts again: every score from the cache
    assert [t.reward for t in again] == [1.0, 0.0, 1.0, 0.0]
    assert judge.stats["requests"] == 4 and judge.stats["cache_hits"] == 4
    kept, _, stats = select_traces(traces, 0, BatchConfig())
    assert len(kept) == 4 and stats.infra_errors == 0


def test_a_judge_that_times_out_is_an_infra_error_counted_never_trained(served):
    urls, samplers = served
    judge = _judge(urls, "slow", timeout_s=0.3, max_retries=1, backoff_s=0.05)
    traces = _rollouts(urls, JudgedEnv(CapitalEnv(), judge), 2)
    assert [t.status for t in traces] == ["infra_error"] * 2
    assert all(t.reward is None for t in traces)
    for t in traces:
        error = t.metadata["artifacts"]["error"]
        assert error.startswith("JudgeUnavailable: RubricJudge(slow at ") and "\n" not in error
        assert "no valid score after 2 attempts: request failed: APITimeoutError" in error
    assert judge.stats["timeouts"] == 4 and judge.stats["retries"] == 2
    assert judge.stats["unavailable"] == 2 and judge._cache == {}  # failures never cached
    kept, _, stats = select_traces(traces, 0, BatchConfig())
    assert kept == [] and stats.infra_errors == 2


def test_invalid_replies_are_retried_with_the_error_fed_back_then_unavailable(served):
    urls, samplers = served
    judge = _judge(urls, "garbled", max_retries=2, backoff_s=0.01)
    before = samplers["garbled"].calls
    with pytest.raises(JudgeUnavailable, match="invalid reply: malformed JSON"):
        judge.score("What is the capital of France?", "Paris")
    assert samplers["garbled"].calls - before == 3
    assert judge.stats["invalid_replies"] == 3 and judge.stats["retries"] == 2
    # the retries carry the bad reply and what was wrong with it
    msgs = judge._reply("nope", judge.messages("q", "a"))[1]
    assert msgs[-2] == {"role": "assistant", "content": "nope"}
    assert msgs[-1]["content"].startswith("Invalid reply: malformed JSON")


def test_backoff_doubles_up_to_its_cap_and_bad_settings_are_named():
    judge = RubricJudge(RUBRIC, "m", "http://127.0.0.1:9/v1", backoff_s=0.5, max_backoff_s=1.5)
    assert [judge._delay(a) for a in range(5)] == [0.0, 0.5, 1.0, 1.5, 1.5]
    with pytest.raises(ValueError, match="give base_url"):
        RubricJudge(RUBRIC, "m")
    with pytest.raises(ValueError, match="rubric must be"):
        RubricJudge("", "m", "http://x/v1")
    for bad, why in (('{"score": 1.5}', "not a number in"), ('{"score": true}', "not a number"),
                     ('{"grade": 1}', 'expected an object {"score": s}')):
        with pytest.raises(ValueError, match=re.escape(why)):
            parse_score_reply(bad)
    assert parse_score_reply('```json\n{"score": 0.25}\n```') == 0.25


def test_no_answer_scores_low_without_asking_and_the_env_is_delegated():
    judge = RubricJudge(RUBRIC, "m", "http://127.0.0.1:9/v1")
    env = JudgedEnv(CapitalEnv(), judge)
    task = env.sample_tasks(1, 0)[0]
    assert env.verify(task, None) == 0.0 and judge.stats["requests"] == 0
    assert env.name == "capital+judge" and env.reference_answer(task) is None
    assert getattr(env, "hint", None) is None  # CapitalEnv has none
    assert check_env(env, "rl") is env and judge.stats["requests"] == 0  # no judge call


def test_the_cache_key_covers_every_setting_that_changes_the_score():
    """Review: the key held (model, rubric, prompt, answer, reference) only, so a judge
    asked at another temperature, token budget or endpoint reused the earlier score."""
    url = "http://127.0.0.1:9/v1"
    key = RubricJudge(RUBRIC, "m", url).key("q", "a", "ref")
    for changed in (dict(temperature=0.7), dict(max_tokens=8), dict(show_reference=True)):
        assert RubricJudge(RUBRIC, "m", url, **changed).key("q", "a", "ref") != key, changed
    assert RubricJudge(RUBRIC, "m", "http://127.0.0.1:10/v1").key("q", "a", "ref") != key
    judge = RubricJudge(RUBRIC, "m", url)
    judge.temperature = 0.7  # a setting changed on a live judge: no stale cache hit
    assert judge.key("q", "a", "ref") != key


def test_a_judge_asks_only_the_endpoint_it_was_given(served, monkeypatch):
    """Review: given only one of client= / async_client=, the other path built an
    openai client with base_url None: api.openai.com (or $OPENAI_BASE_URL) was asked
    with the task and the answer. Now ascore runs the sync client off the loop, and
    score with only an async client is refused in one line."""
    import openai

    urls, samplers = served
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1")  # where base_url None goes
    q = "What is the capital of France?"
    sync = openai.OpenAI(base_url=urls["judge"] + "/v1", api_key=ADMIN, max_retries=0)
    judge = RubricJudge(RUBRIC, "judge", client=sync, max_retries=0, timeout_s=5)
    assert asyncio.run(judge.ascore(q, "Paris")) == 1.0
    aio = openai.AsyncOpenAI(base_url=urls["judge"] + "/v1", api_key=ADMIN, max_retries=0)
    judge = RubricJudge(RUBRIC, "judge", async_client=aio, max_retries=0, timeout_s=5)
    with pytest.raises(ValueError, match=r"only async_client was given.*ascore"):
        judge.score(q, "Paris")
    assert judge.stats["requests"] == 0


def test_a_negative_backoff_cap_is_named():
    """Review: max_backoff_s < 0 was taken; the first retry's time.sleep then raised
    ValueError (not JudgeUnavailable) out of score."""
    with pytest.raises(ValueError, match="max_backoff_s >= 0"):
        RubricJudge(RUBRIC, "m", "http://127.0.0.1:9/v1", max_backoff_s=-1.0)


def test_a_refused_request_is_not_retried(served):
    """Review: a 4xx the judge endpoint refuses (a wrong key, an unknown model) was
    retried max_retries times with backoff; the same request gets the same answer, so
    it is JudgeUnavailable at once, naming it."""
    urls, samplers = served
    before = samplers["judge"].calls
    judge = RubricJudge(RUBRIC, "judge", base_url=urls["judge"] + "/v1", api_key="wrong",
                        max_retries=3, backoff_s=5.0)
    with pytest.raises(JudgeUnavailable, match="AuthenticationError"):
        judge.score("What is the capital of France?", "Paris")
    with pytest.raises(JudgeUnavailable, match="AuthenticationError"):
        asyncio.run(judge.ascore("What is the capital of France?", "Paris"))
    assert judge.stats["requests"] == 2 and judge.stats["retries"] == 0
    assert samplers["judge"].calls == before
