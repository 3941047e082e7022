"""run_rollout over the real endpoint: how an attempt ends, and whose fault a failure is.

A tiny random model behind the FastAPI endpoint (JaxSampler), the official
openai client, real HTTP. Our failures (a crashed harness, a failing sampler,
an HTTP 5xx) end as `infra_error` and never reach a batch; the agent's own
faults end as `agent_error`; a wrong answer is `finished` with reward 0 and
is trained.
"""

import asyncio
import dataclasses
import os
import subprocess
import sys

import numpy as np
import openai
import pytest
from fastapi import FastAPI

from ac2_jax.envs import AgentError, Env, Task
from ac2_jax.orchestration import (
    DefaultOrchestrator,
    LifecycleClient,
    MultiResponseOrchestrator,
    run_rollout,
)
from ac2_jax.sampling.remote.sglang import SGLangSampler
from ac2_jax.serving.app import build_app
from ac2_jax.serving.core.errors import install_error_handlers
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.trace import TraceStore
from ac2_jax.training.rl import BatchConfig, build_batch
from tests.support.ports import refused_url
from tests.support.serving_helpers import served_random_model

ADMIN = "sk-admin-rollouts"
SAMPLING = {"temperature": 1.0, "max_tokens": 6, "seed": 7}


class ExactEnv(Env):
    """Reward 1 when the answer is exactly the task's answer."""

    def sample_tasks(self, n, seed, split="train"):
        return [Task(task_id=f"say-{i}", prompt="Say something.", answer="17") for i in range(n)]

    def verify(self, task, answer):
        return float((answer or "").strip() == task.answer)


class CrashingOrchestrator(DefaultOrchestrator):
    """A harness whose sandbox dies after the first model call (our fault)."""

    async def run(self, turn_input):
        self.trace.messages.append({"role": "user", "content": turn_input})
        await self.step(self.trace.messages)
        raise RuntimeError("sandbox crashed")


class GivingUpOrchestrator(DefaultOrchestrator):
    """A harness that finds the agent's reply unusable (the agent's fault)."""

    async def run(self, turn_input):
        self.trace.messages.append({"role": "user", "content": turn_input})
        await self.step(self.trace.messages)
        raise AgentError("the reply is not a parsable answer")


class QuittingOrchestrator(DefaultOrchestrator):
    """A policy that, after its (wrong) answer, ends its own rollout with its key,
    hoping to escape its grade; `then_ask`: and the harness then asks it once more."""

    rollout_id: str | None = None
    then_ask = False

    async def run(self, turn_input):
        await super().run(turn_input)
        await self.client.post(f"/rollouts/{self.rollout_id}/finish", body={}, cast_to=object)
        if self.then_ask:
            await self.step(self.trace.messages)


class RecordingLifecycle(LifecycleClient):
    """Remembers the rollouts it creates (so a test harness can learn its id)."""

    created: list[dict] = []

    async def create(self, *args, **kw):
        info = await super().create(*args, **kw)
        self.created = self.created + [info]
        return info


def make(cls=DefaultOrchestrator, **kw):
    return lambda e, t, c, m: cls(e, t, c, m, sampling=SAMPLING, **{"max_steps": 1, **kw})


def _serve(sampler, tok, trace_store=None):
    return serve_in_thread(build_app(sampler, tok, admin_key=ADMIN, model_name="tiny",
                                     trace_store=trace_store))


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollouts")
    store = TraceStore(str(tmp / "traces.jsonl"))
    with served_random_model(tmp, ADMIN, max_context=256, trace_store=store) as (url, tok):
        yield dict(url=url, tok=tok, env=ExactEnv(), store=store)


def run(url, env, make_orchestrator, task=None, group_id="g"):
    async def go():
        lc = LifecycleClient(url, ADMIN)
        try:
            return await run_rollout(lc, env, task or env.sample_tasks(1, 0)[0],
                                     make_orchestrator, "tiny", group_id=group_id)
        finally:
            await lc.aclose()
    return asyncio.run(go())


def never_trained(trace):
    batch, stats, _ = build_batch([trace], 0, BatchConfig(seq_len=128, rows=1))
    return batch is None and stats.infra_errors == 1


def test_harness_crash_mid_rollout_is_infra_error(endpoint):
    trace, conv = run(endpoint["url"], endpoint["env"], make(CrashingOrchestrator))
    assert trace.status == "infra_error" and trace.reward is None
    assert trace.metadata["artifacts"]["error"] == "RuntimeError: sandbox crashed"
    assert len(trace.episodes[0].completions) == 1 and conv.metrics["steps"] == 1  # mid-rollout
    assert conv.status == "infra_error" and never_trained(trace)


def test_sampler_error_is_infra_error(endpoint):
    dead = refused_url()  # SGLang "down": a port nothing listens on
    url, stop = _serve(SGLangSampler(dead, max_context=256), endpoint["tok"])
    try:
        trace, conv = run(url, endpoint["env"], make())
    finally:
        stop()
    # The endpoint ended the rollout itself; run_rollout keeps that status.
    assert trace.status == "infra_error"
    assert "SGLangUnavailable" in trace.metadata["artifacts"]["error"]
    assert conv.status == "infra_error" and never_trained(trace)


def test_http_500_is_infra_error(endpoint):
    """The harness's model calls go through a gateway that answers 500: our outage."""
    gateway = FastAPI()
    install_error_handlers(gateway)

    @gateway.post("/v1/chat/completions")
    async def broken():
        raise RuntimeError("upstream overloaded")

    gw_url, stop = serve_in_thread(gateway)

    def via_gateway(e, t, c, m):
        client = openai.AsyncOpenAI(base_url=gw_url + "/v1", api_key="k", max_retries=0)
        return DefaultOrchestrator(e, t, client, m, sampling=SAMPLING)

    try:
        trace, conv = run(endpoint["url"], endpoint["env"], via_gateway)
    finally:
        stop()
    assert trace.status == "infra_error" and not trace.episodes
    assert trace.metadata["artifacts"]["error"].startswith("InternalServerError")
    assert never_trained(trace)


def test_agent_faults_are_agent_error_and_trained(endpoint):
    url, env = endpoint["url"], endpoint["env"]
    gave_up, conv = run(url, env, make(GivingUpOrchestrator))
    assert gave_up.status == "agent_error" and conv.status == "agent_error"
    assert "not a parsable answer" in gave_up.metadata["artifacts"]["error"]
    out_of_steps, conv = run(url, env, make(max_steps=0))
    assert out_of_steps.status == "agent_error" and out_of_steps.reward == 0.0
    assert out_of_steps.metadata["artifacts"]["orchestrator_status"] == "step_limit"
    long_task = Task(task_id="long", prompt="word " * 300, answer="17")  # > 256 tokens
    overflow, conv = run(url, env, make(), task=long_task)
    assert overflow.status == "agent_error" and "context length" in overflow.metadata[
        "artifacts"]["error"]
    batch, stats, adv = build_batch([gave_up], 0, BatchConfig(seq_len=128, rows=1,
                                                               agent_error_reward=-1.0))
    assert stats.agent_errors == 1 and batch.loss_mask.sum() == gave_up.num_agent_tokens > 0


def test_wrong_answer_is_finished_with_reward_0_and_trained(endpoint):
    url, env = endpoint["url"], endpoint["env"]
    task = env.sample_tasks(1, 0)[0]  # expects "17", which the tiny random policy never says
    wrong, conv = run(url, env, make(), task)
    assert wrong.status == "finished" and wrong.reward == 0.0
    # Same prompt, same seed: the same answer, which this task's verifier accepts.
    right_task = dataclasses.replace(task, answer=(conv.answer or "").strip())
    right, _ = run(url, env, make(), right_task)
    assert right.status == "finished" and right.reward == 1.0
    crashed, _ = run(url, env, make(CrashingOrchestrator), task)  # same group, our fault
    batch, stats, adv = build_batch([wrong, right, crashed], 0, BatchConfig(seq_len=128, rows=2))
    np.testing.assert_allclose(adv, [-0.5, 0.5])
    assert stats.finished == 2 and stats.infra_errors == 1
    agent_adv = batch.features["advantages"][batch.loss_mask > 0]
    assert batch.loss_mask.sum() == wrong.num_agent_tokens + right.num_agent_tokens
    assert (agent_adv < 0).sum() == wrong.num_agent_tokens > 0


def test_a_mixed_domain_task_is_verified_by_its_own_env(endpoint):
    """evaluate() given a DomainMixer used to score every rollout 0 (the mixer has no verify)."""
    from ac2_jax.envs.mixer import DomainMixer

    mixer = DomainMixer({"say": endpoint["env"]})
    task = mixer.sample_tasks(1, 0)[0]
    trace, _ = run(endpoint["url"], mixer, make(), task)
    assert trace.status == "finished" and trace.reward == 0.0


@pytest.mark.parametrize("then_ask", [False, True])
def test_a_policy_that_ends_its_own_rollout_is_still_graded(endpoint, then_ask):
    """Ending its rollout early (its key's empty finish) does not escape the grade:
    run_rollout's finish still sets the verifier's reward, the stored trace has it
    and trains. A harness that asks the policy again after that gets a 401 that is
    the agent's doing (agent_error, trained), not an outage (infra_error, dropped)."""
    url, env, store = endpoint["url"], endpoint["env"], endpoint["store"]
    task = env.sample_tasks(1, 0)[0]  # expects "17", which the tiny random policy never says

    async def go():
        lc = RecordingLifecycle(url, ADMIN)

        def make_quitter(e, t, c, m):
            orch = QuittingOrchestrator(e, t, c, m, sampling=SAMPLING, max_steps=1)
            orch.rollout_id, orch.then_ask = lc.created[-1]["rollout_id"], then_ask
            return orch
        try:
            return await run_rollout(lc, env, task, make_quitter, "tiny", group_id="quit"), lc
        finally:
            await lc.aclose()

    (trace, conv), lc = asyncio.run(go())
    rid = lc.created[-1]["rollout_id"]
    (stored,) = [t for t in store.load() if t.metadata["rollout_id"] == rid]
    assert stored.to_dict() == trace.to_dict() | {"metrics": stored.metrics}
    assert len(stored.episodes[0].completions) == 1
    if then_ask:
        assert stored.status == "agent_error" and conv.status == "agent_error"
        assert "ended its own rollout" in stored.metadata["artifacts"]["error"]
        _, stats, _ = build_batch([stored], 0, BatchConfig(seq_len=128, rows=1))
        assert stats.agent_errors == 1 and stats.infra_errors == 0
    else:
        assert stored.status == "finished" and stored.reward == 0.0  # the verifier's reward
        assert stored.metadata["artifacts"]["orchestrator_status"] == "finished"
        batch, stats, _ = build_batch([stored], 0, BatchConfig(seq_len=128, rows=1))
        assert stats.finished == 1 and stats.dropped_no_reward == 0
        assert batch.loss_mask.sum() == stored.num_agent_tokens > 0


def test_rollouts_share_one_ssl_context_and_close_their_clients(endpoint, monkeypatch):
    """Each rollout's model client is its own (closed after the rollout) but built
    on the lifecycle client's one SSL context: a default client per rollout loaded
    the CA bundle each time (~35 ms of CPU, the demo collector's bottleneck)."""
    import ssl

    made, clients = [], []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context",
                        lambda *a, **k: made.append(1) or real(*a, **k))

    async def go():
        lc = LifecycleClient(endpoint["url"], ADMIN)
        fresh = lc.rollout_http
        lc.rollout_http = lambda: clients.append(fresh()) or clients[-1]
        try:
            tasks = endpoint["env"].sample_tasks(3, 0)
            return await asyncio.gather(*[run_rollout(lc, endpoint["env"], t, make(), "tiny")
                                          for t in tasks])
        finally:
            await lc.aclose()

    results = asyncio.run(go())
    assert [t.status for t, _ in results] == ["finished"] * 3
    # The lifecycle client's own context and one shared by the rollouts (before: 1 + 3).
    assert len(made) == 2
    assert len(clients) == 3 and len({id(c) for c in clients}) == 3
    assert all(c.is_closed for c in clients)


def test_each_rollout_speaks_over_its_own_client_only(endpoint):
    """create, the model calls, finish and trace of a rollout all go over its own
    HTTP client (one connection), the lifecycle calls with the lifecycle client's
    timeout; the lifecycle client's shared pool sends none of them. Through one
    shared pool, httpcore checks every pooled connection on each request: with 64
    rollouts at once that scan was most of the collector's time."""
    sent = {}

    def hook(name):
        async def on_request(request):
            timeout = request.extensions["timeout"]["read"]
            sent.setdefault(name, []).append((request.url.path, timeout))
        return on_request

    async def go():
        lc = LifecycleClient(endpoint["url"], ADMIN, timeout_s=30.0)
        lc._http.event_hooks["request"].append(hook("shared"))
        fresh, made = lc.rollout_http, []

        def own():
            c = fresh()
            c.event_hooks["request"].append(hook(f"rollout{len(made)}"))
            made.append(c)
            return c

        lc.rollout_http = own
        try:
            tasks = endpoint["env"].sample_tasks(3, 0)
            out = await asyncio.gather(*[run_rollout(lc, endpoint["env"], t, make(), "tiny")
                                         for t in tasks])
            calls = lc.calls
        finally:
            await lc.aclose()
        return out, made, calls

    results, made, calls = asyncio.run(go())
    assert [t.status for t, _ in results] == ["finished"] * 3
    assert "shared" not in sent and len(made) == 3 and all(c.is_closed for c in made)
    for i in range(3):
        paths = [p for p, _ in sent[f"rollout{i}"]]
        assert paths[0] == "/v1/rollouts" and paths[-1].endswith("/trace"), paths
        assert paths[-2].endswith("/finish") and any("chat/completions" in p for p in paths)
        # The lifecycle calls keep the lifecycle client's timeout (the model calls: openai's).
        assert {t for p, t in sent[f"rollout{i}"] if "/v1/rollouts" in p} == {30.0}
    assert calls == 9  # create, finish, trace per rollout, counted as before


class _SecondChoice:
    """A best-of-n score that prefers each request's second response (index 1)."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, text):
        self.calls += 1
        return float((self.calls - 1) % self.n == 1)


class ChoosingThenFailingOrchestrator(MultiResponseOrchestrator):
    """Two responses per request, continues the second, then the harness gives up
    (the agent's fault): the rollout ends agent_error after a recorded branch choice."""

    def __init__(self, *args, **kw):
        super().__init__(*args, n=2, select=_SecondChoice(2), **kw)

    async def run(self, turn_input):
        self.trace.messages.append({"role": "user", "content": turn_input})
        await self.step(self.trace.messages)
        raise AgentError("the reply is not a parsable answer")


def _branch_members(trace, agent="main"):
    """The completions of each multi-response request of `agent`, in choice order:
    members share one prompt; the first recorded is choice 0, then 1, ... (the
    endpoint records a request's n responses in order)."""
    groups: dict[tuple, list] = {}
    for ep in trace.episodes:
        if ep.agent == agent:
            for c in ep.completions:
                groups.setdefault(tuple(c.prompt_ids), []).append(c)
    return [g for g in groups.values() if len(g) > 1]


def test_an_errored_multi_response_attempt_trains_its_chosen_branch(endpoint):
    """Finding 2 (issue 32): the error path kept no metrics, so branch_choices was lost
    and the unchosen branch trained in place of the chosen one."""
    trace, conv = run(endpoint["url"], endpoint["env"], make(ChoosingThenFailingOrchestrator))
    assert trace.status == "agent_error" and conv.metrics["branch_choices"]
    assert trace.metadata["artifacts"]["metrics"]["steps"] == 1  # the metrics reach the trace
    (group,) = _branch_members(trace)
    chosen, other = group[1], group[0]
    assert chosen.output_ids and other.output_ids
    batch, stats, _ = build_batch([trace], 0, BatchConfig(seq_len=128, rows=1,
                                                           agent_error_reward=0.0))
    trained = np.asarray(batch.targets)[np.asarray(batch.loss_mask) > 0].tolist()
    assert trained == list(chosen.output_ids)


class TwoTurnBranchingOrchestrator(MultiResponseOrchestrator):
    """Two requests with n=2, each continuing its second response: the continued
    path is (request 1, choice 1) then (request 2, choice 1)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, n=2, select=_SecondChoice(2), **kw)

    async def run(self, turn_input):
        msgs = self.trace.messages
        msgs.append({"role": "user", "content": turn_input})
        for follow_up in ("Say more.", None):
            msg = await self.step(msgs)
            msgs.append({"role": "assistant", "content": msg.content or ""})
            if follow_up:
                msgs.append({"role": "user", "content": follow_up})
        self.trace.answer, self.trace.status = msgs[-1]["content"], "finished"


def test_the_continued_path_of_later_choices_trains_every_token_once(endpoint):
    """Finding 1 (issue 32): when the continued response is not the one that extends
    the existing episode, the turns it continued were dropped with that episode."""
    trace, conv = run(endpoint["url"], endpoint["env"], make(TwoTurnBranchingOrchestrator,
                                                             max_steps=4))
    assert trace.status == "finished"
    assert [c["index"] for c in conv.metrics["branch_choices"]] == [1, 1]
    groups = sorted(_branch_members(trace), key=lambda g: len(g[0].prompt_ids))
    assert len(groups) == 2
    continued = [g[1] for g in groups]  # choice 1 of each request
    assert all(c.output_ids for c in continued)
    batch, stats, _ = build_batch([trace], 0, BatchConfig(seq_len=256, rows=1))
    trained = sorted(np.asarray(batch.targets)[np.asarray(batch.loss_mask) > 0].tolist())
    assert trained == sorted(t for c in continued for t in c.output_ids)


@pytest.mark.full  # a child Python process imports the packages
def test_the_training_packages_import_without_openai():
    """A GPU machine that only benchmarks training (benchmarks/gpu_bench.py) may lack
    openai: rollouts imports it when a rollout runs, and says what to install."""
    probe = (
        "import sys; sys.modules['openai'] = None\n"  # None in sys.modules: import fails
        "import ac2_jax.training, ac2_jax.training.rl\n"
        "from ac2_jax.orchestration import classify_error, rollouts\n"
        "assert classify_error(RuntimeError('x')) == 'infra_error'\n"
        "try:\n"
        "    rollouts._openai_module()\n"
        "except ImportError as e:\n"
        "    assert 'ac2_jax[serve]' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('openai imported')\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_multi_turn_env_replies_to_each_answer_in_one_episode_that_replays(endpoint):
    """GuessEnv plays the user (`reply`): every answer gets "Higher." / "Lower." / a request
    for a number until the guesses run out (the random policy never wins), all in one
    append-only episode of one completion per guess. The replies recompute from the
    recorded conversation (`replay_replies`), and the same seed rolls the same attempt."""
    from ac2_jax.envs import GuessEnv, replay_replies

    env = GuessEnv(highs=(7,), max_guesses=3)
    task = env.sample_tasks(1, 0)[0]
    trace, conv = run(endpoint["url"], env, make(max_steps=5), task)
    assert trace.status == "finished" and conv.status == "finished"
    assert trace.reward == env.verify(task, conv.answer) == 0.0
    answers = [m for m in conv.messages if m["role"] == "assistant"]
    users = [m["content"] for m in conv.messages if m["role"] == "user"]
    assert len(answers) == 3 and users[0] == task.prompt and len(users) == 3
    assert replay_replies(env, task, conv.messages) == [*users[1:], None]
    assert len(trace.episodes) == 1 and len(trace.episodes[0].completions) == 3
    again, conv2 = run(endpoint["url"], env, make(max_steps=5), task)
    assert conv2.messages == conv.messages
    assert again.episodes[0].token_ids == trace.episodes[0].token_ids
    # The step limit ends the game first: an agent_error, no further reply.
    short, conv3 = run(endpoint["url"], env, make(max_steps=2), task)
    assert short.status == "agent_error" and conv3.status == "step_limit"
    assert sum(m["role"] == "assistant" for m in conv3.messages) == 2


def test_an_env_that_scores_each_turn_feeds_per_turn_credit(endpoint):
    """`Env.turn_rewards` (issue 64): run_rollout records one reward per assistant turn with
    the attempt, and per-turn credit (rl.batch.credit="turn") reads them from the trace."""
    from ac2_jax.envs import GuessEnv
    from ac2_jax.training.rl import batch_segments

    class ScoredGuessEnv(GuessEnv):
        def turn_rewards(self, task, messages):
            turns = [m for m in messages if m["role"] == "assistant"]
            return [0.1 * (i + 1) for i in range(len(turns))]

    env = ScoredGuessEnv(highs=(7,), max_guesses=3)
    task = env.sample_tasks(1, 0)[0]
    trace, _ = run(endpoint["url"], env, make(max_steps=5), task)
    assert trace.status == "finished"
    assert trace.metadata["artifacts"]["turn_rewards"] == pytest.approx([0.1, 0.2, 0.3])
    other, _ = run(endpoint["url"], GuessEnv(highs=(7,), max_guesses=3), make(max_steps=5), task)
    assert "turn_rewards" not in other.metadata["artifacts"]  # the default: none
    other = dataclasses.replace(other, attempt_id=other.attempt_id + "-b")
    segs, stats, _ = batch_segments([trace, other], 0,
                                    BatchConfig(seq_len=256, rows=2, credit="turn"))
    assert stats.turn_credit_traces == 1 and stats.final_credit_traces == 1
    # returns-to-go 0.6, 0.5, 0.3 against the other attempt's 0, 0, 0 (reward 0 at the end)
    adv = np.asarray(segs[0].features["advantages"])[np.asarray(segs[0].loss_mask) > 0]
    np.testing.assert_allclose(sorted(set(np.round(adv, 6))), [0.15, 0.25, 0.3], atol=1e-6)


class OutOfRangeEnv(ExactEnv):
    """A verifier that breaks its own reward_range (an env bug, not the agent's)."""

    def verify(self, task, answer):
        return 2.0


def test_a_reward_outside_the_envs_range_ends_the_rollout_infra_error(endpoint):
    """The endpoint refuses the finish (400 naming the range); the attempt is then
    finished infra_error with that refusal kept (never trained, counted), not left open on
    the endpoint with its tokens."""
    trace, _ = run(endpoint["url"], OutOfRangeEnv(), make())
    assert trace.status == "infra_error" and trace.reward is None
    assert "outside the rollout's reward_range [0.0, 1.0]" in trace.metadata["artifacts"]["error"]
    assert len(trace.episodes[0].completions) == 1 and never_trained(trace)
