"""The RL loop through the real endpoint: smoke run, sync == async, resume.

Tiny random model; mostly the toy env of experiments/rl_split/run.py, whose reward
varies with what the model writes (answer length parity): most groups have
non-zero advantages, but a step of 2 groups x 4 ties by chance 1 time in 64
(no update). Tests that need every step to update use `AlternatingEnv` (same module), whose
rewards within a group always differ. Rollouts go openai client -> FastAPI
endpoint -> JaxSampler.
"""

import asyncio
import collections
import dataclasses
import os
import threading

import httpx
import jax
import numpy as np
import pytest
from flax import nnx

from ac2_jax.envs import Task
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.models.io.params_io import latest_published
from ac2_jax.orchestration import DefaultOrchestrator, LifecycleClient
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.sampling.remote.sglang import SGLangSampler
from ac2_jax.serving.app import build_app
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.trace import Trace, TraceStore
from ac2_jax.training import OptimizerConfig, PolicyGradientLoss
from ac2_jax.training.core import StepCache, read_metrics
from ac2_jax.training.rl.data import BatchConfig, select_traces
from ac2_jax.training.rl.trainer import EndpointCollector, ReplayCollector, RLConfig, RLTrainer
from experiments.rl_split.toy_envs import AlternatingEnv, LengthParityEnv
from tests.support.ports import refused_url

ADMIN = "sk-admin-rl"
STEPS = StepCache()  # trainers of equal configuration share one compiled step


def _model(vocab):
    cfg = DecoderConfig.tiny(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                             num_heads=2, num_kv_heads=1, head_dim=16,
                             max_position_embeddings=256)
    return Decoder(cfg, rngs=nnx.Rngs(0))


def _config(steps, mode="sync", concurrency=64):
    return RLConfig(steps=steps, tasks_per_step=2, attempts_per_task=4, mode=mode,
                    concurrency=concurrency,
                    batch=BatchConfig(seq_len=128, rows=8),
                    loss=PolicyGradientLoss(), optimizer=OptimizerConfig(learning_rate=1e-2))


def _make(env, task, client, model):
    return DefaultOrchestrator(env, task, client, model, max_steps=1,
                               sampling={"temperature": 1.0, "max_tokens": 6})


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rl")
    tok = build_tiny_tokenizer(str(tmp / "tok"))
    sampler = JaxSampler(_model(tok.vocab_size), publish_dir=str(tmp / "run" / "published"),
                         max_context=256, max_batch=8, min_batch=8, min_cache_len=256,
                         eos_token_ids=tok.stop_token_ids, tokenizer=tok, seed=0)
    app = build_app(sampler, tok, admin_key=ADMIN, model_name="tiny")
    url, stop = serve_in_thread(app)
    yield dict(tmp=tmp, tok=tok, sampler=sampler, url=url)
    stop()
    sampler.close()


def _collector(served, store, attempts=4, env=LengthParityEnv):
    lc = LifecycleClient(served["url"], ADMIN)
    return lc, EndpointCollector(lc, env(), _make, "tiny", store, tasks_per_step=2,
                                 attempts_per_task=attempts, seed=0)


def _params(model_or_trainer):
    m = model_or_trainer.model() if isinstance(model_or_trainer, RLTrainer) else model_or_trainer
    return jax.tree.map(np.asarray, nnx.state(m, nnx.Param))


def test_two_step_smoke_and_resume(served):
    """Two steps, "killed" in between, each of which must update (AlternatingEnv: the
    update, the publish and the resume are what is checked; a tied step has none)."""
    workdir = str(served["tmp"] / "run")
    store = TraceStore(os.path.join(workdir, "rollouts.jsonl"))
    sampler = served["sampler"]

    async def first_run():
        lc, collector = _collector(served, store, env=AlternatingEnv)
        trainer = RLTrainer(_model(served["tok"].vocab_size), collector, _config(1), workdir,
                            on_publish=sampler.load_weights, make_step=STEPS)
        before = _params(trainer)
        history = await trainer.run()
        trainer.close()
        # "Killed" after step 0, while step 1's rollouts were half collected.
        await EndpointCollector(lc, AlternatingEnv(), _make, "tiny", store, tasks_per_step=2,
                                attempts_per_task=2, seed=0).collect(1)
        await lc.aclose()
        return before, _params(trainer), history

    before, after_0, history = asyncio.run(first_run())
    assert history[0]["zero_advantage_groups"] == 0.0
    assert history[0]["adv_abs_mean"] == pytest.approx(0.5, rel=1e-6)  # rewards 1, 0, 1, 0
    assert history[0]["skipped_update"] == 0.0
    changed = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), before, after_0)
    assert max(jax.tree.leaves(changed)) > 0, "weights did not change"
    assert latest_published(os.path.join(workdir, "published")) == 1
    assert sampler.policy_version == 1

    async def resumed_run():
        lc, collector = _collector(served, store, env=AlternatingEnv)
        trainer = RLTrainer(_model(served["tok"].vocab_size), collector, _config(2), workdir,
                            on_publish=sampler.load_weights, make_step=STEPS)
        assert trainer.start_step == 1 and trainer.version == 1
        np.testing.assert_allclose(jax.tree.leaves(_params(trainer))[0],
                                   jax.tree.leaves(after_0)[0])
        history = await trainer.run()
        trainer.close()
        await lc.aclose()
        return history

    history = asyncio.run(resumed_run())
    assert [h["rl_step"] for h in history] == [1]
    # Step 1's group: attempts 0-1 from the killed collector, 2-3 from this one: 1, 0, 1, 0.
    assert history[0]["zero_advantage_groups"] == 0.0 and history[0]["skipped_update"] == 0.0
    assert sampler.policy_version == 2
    stored = store.load()
    keys = [(t.metadata["rl_step"], t.task_id, t.metadata["attempt"]) for t in stored]
    assert len(keys) == len(set(keys)) == 2 * 2 * 4  # no rollout repeated or lost
    # Step 1's rollouts were sampled by the weights published after step 0.
    versions = {c.policy_version for t in stored if t.metadata["rl_step"] == 1
                for e in t.episodes for c in e.completions}
    assert versions == {1}
    assert all(t.status == "finished" and t.reward in (0.0, 1.0) for t in stored)

    async def rerun_after_the_end():
        # A rerun once every step is trained must still publish the trained weights.
        lc, collector = _collector(served, store, env=AlternatingEnv)
        published = []
        trainer = RLTrainer(_model(served["tok"].vocab_size), collector, _config(2), workdir,
                            on_publish=published.append, make_step=STEPS)
        history = await trainer.run()
        trainer.close()
        await lc.aclose()
        return history, published

    history, published = asyncio.run(rerun_after_the_end())
    assert history == [] and published == [2]
    # One train/ line per trained step, across the resume; checkpoints named by steps done.
    rows = read_metrics(os.path.join(workdir, "metrics", "metrics.jsonl"))
    assert [(r["step"], r["train/rl_step"]) for r in rows] == [(1, 0), (2, 1)]
    assert all("train/reward_mean" in r and "train/skipped_update" in r for r in rows)
    assert sorted(d for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()) \
        == ["1", "2"]


def test_sync_and_async_first_updates_are_identical(served):
    traces = TraceStore(os.path.join(str(served["tmp"] / "run"), "rollouts.jsonl")).load()
    if not traces:
        pytest.skip("needs the rollouts of test_two_step_smoke_and_resume")
    results = {}
    for mode in ("sync", "async"):
        trainer = RLTrainer(_model(served["tok"].vocab_size), ReplayCollector(traces),
                            _config(2, mode), str(served["tmp"] / f"replay_{mode}"),
                            make_step=STEPS)
        history = asyncio.run(trainer.run())
        results[mode] = (history, _params(trainer))
        trainer.close()
    (h_s, p_s), (h_a, p_a) = results["sync"], results["async"]
    assert h_s[0]["loss"] == pytest.approx(h_a[0]["loss"], rel=1e-6)
    for a, b in zip(jax.tree.leaves(p_s), jax.tree.leaves(p_a)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # Step 1's replayed traces were sampled at version 1 = learner version 1: not stale.
    assert h_s[1]["dropped_stale"] == 0 and h_s[1]["staleness_max"] == 0


def test_stale_traces_are_dropped_in_the_loop(served):
    traces = TraceStore(os.path.join(str(served["tmp"] / "run"), "rollouts.jsonl")).load()
    if not traces:
        pytest.skip("needs the rollouts of test_two_step_smoke_and_resume")
    step0 = [t for t in traces if t.metadata["rl_step"] == 0]  # sampled at version 0
    # Replay step 0's traces again at step 1, when the learner is at version 1:
    # lag 1 > max_staleness 0, so the loop must drop them (or down-weight them).
    replay = step0 + [Trace.from_dict({**t.to_dict(), "metadata": {**t.metadata, "rl_step": 1}})
                      for t in step0]
    for stale, check in (("drop", lambda h: h["dropped_stale"] == len(step0)
                          and h["skipped_update"] == 1.0),
                         ("downweight", lambda h: h["downweighted"] == len(step0)
                          and h["skipped_update"] == 0.0)):
        config = RLConfig(steps=2, tasks_per_step=2, attempts_per_task=4,
                          batch=BatchConfig(seq_len=128, rows=8, max_staleness=0, stale=stale))
        trainer = RLTrainer(_model(served["tok"].vocab_size), ReplayCollector(replay), config,
                            str(served["tmp"] / f"stale_{stale}"), make_step=STEPS)
        history = asyncio.run(trainer.run())
        trainer.close()
        assert history[0]["dropped_stale"] == 0 and history[0]["skipped_update"] == 0.0
        assert history[1]["staleness_max"] == 1 and check(history[1]), history[1]


class CrashingOrchestrator(DefaultOrchestrator):
    """A harness whose sandbox dies after the first model call (our fault)."""

    async def run(self, turn_input):
        self.trace.messages.append({"role": "user", "content": turn_input})
        await self.step(self.trace.messages)
        raise RuntimeError("sandbox crashed")


def _learner(served, tmp):
    config = RLConfig(steps=1, tasks_per_step=2, attempts_per_task=2,
                      batch=BatchConfig(seq_len=128, rows=4))
    return RLTrainer(_model(served["tok"].vocab_size), ReplayCollector([]), config, str(tmp),
                     make_step=STEPS)


def test_collector_retries_infra_errors_and_they_never_reach_a_batch(served):
    """Task 0's harness always crashes mid-rollout; task 1's crashes on its first two runs."""
    runs = collections.Counter()

    def flaky(env, task, client, model):
        runs[task.task_id] += 1
        if task.task_id.endswith("-0") or runs[task.task_id] <= 2:
            return CrashingOrchestrator(env, task, client, model, max_steps=1,
                                        sampling={"temperature": 1.0, "max_tokens": 6})
        return _make(env, task, client, model)

    store = TraceStore(str(served["tmp"] / "flaky" / "rollouts.jsonl"))

    async def go():
        lc = LifecycleClient(served["url"], ADMIN)
        try:
            return await EndpointCollector(lc, LengthParityEnv(), flaky, "tiny", store,
                                           tasks_per_step=2, attempts_per_task=2,
                                           infra_retries=2, infra_backoff_s=0.01).collect(0)
        finally:
            await lc.aclose()

    traces = asyncio.run(go())
    task0, task1 = sorted(runs)
    assert runs == {task0: 2 * 3, task1: 2 + 2}  # 1 try + 2 retries each; 2 crashes then fine
    status = {(t.task_id, t.attempt_id): t.status for t in traces}
    assert status == {(task0, "0"): "infra_error", (task0, "1"): "infra_error",
                      (task1, "0"): "finished", (task1, "1"): "finished"}
    assert all(t.metadata["artifacts"]["error"] == "RuntimeError: sandbox crashed"
               for t in traces if t.task_id == task0)
    # The store holds the last run of each attempt, tagged with its retries.
    stored = {(t.task_id, t.attempt_id): (t.status, t.metadata["infra_retries"])
              for t in store.load()}
    assert len(store.load()) == 4 and {k: v[0] for k, v in stored.items()} == status
    assert sum(v[1] for v in stored.values()) == 2 * 2 + 2
    trainer = _learner(served, served["tmp"] / "flaky_learner")
    m = trainer.update(traces)
    trainer.close()
    assert m["infra_retries"] == 2 * 2 + 2 and m["infra_errors"] == 2 and m["finished"] == 2
    kept, _, _ = select_traces(traces, 0, trainer.config.batch)
    assert {t.task_id for t in kept} == {task1}  # the crashed rollouts never reach the batch


@pytest.mark.parametrize("failure", ["sampler_down", "trace_store_500", "endpoint_down"])
def test_infra_failures_are_retried_counted_and_never_kill_the_step(served, tmp_path, failure):
    """A failing sampler (the endpoint answers 500 and ends the rollout), an HTTP 500
    on finish (the endpoint's trace store is broken: run_rollout raises), an
    unreachable endpoint: every rollout ends infra_error, the step goes on."""
    dead = refused_url()  # a port nothing listens on
    stop = None
    if failure == "endpoint_down":
        url = dead
    else:
        sampler, store = served["sampler"], None
        if failure == "sampler_down":
            sampler = SGLangSampler(dead, max_context=256)
        else:
            (tmp_path / "blocker").write_text("x")  # appending under a file fails
            store = TraceStore(str(tmp_path / "ok.jsonl"))
            store.path = str(tmp_path / "blocker" / "traces.jsonl")
        url, stop = serve_in_thread(build_app(sampler, served["tok"], admin_key=ADMIN,
                                              model_name="tiny", trace_store=store))

    async def go():
        lc = LifecycleClient(url, ADMIN)
        try:
            return await EndpointCollector(
                lc, LengthParityEnv(), _make, "tiny", TraceStore(str(tmp_path / "rollouts.jsonl")),
                tasks_per_step=2, attempts_per_task=2, infra_retries=1,
                infra_backoff_s=0.01).collect(0)
        finally:
            await lc.aclose()

    try:
        traces = asyncio.run(go())
    finally:
        if stop is not None:
            stop()
    assert len(traces) == 4 and all(t.status == "infra_error" for t in traces)
    expected = {"sampler_down": "SGLangUnavailable", "trace_store_500": "HTTP 500",
                "endpoint_down": "ConnectError"}[failure]
    assert all(expected in t.metadata["artifacts"]["error"] for t in traces), traces[0].metadata
    trainer = _learner(served, tmp_path / "learner")
    m = trainer.update(traces)
    trainer.close()
    assert m["infra_retries"] == 4 and m["infra_errors"] == 4 and m["skipped_update"] == 1.0


class SlowOrchestrator(DefaultOrchestrator):
    """Waits `delay` seconds before its first model call (a slow or hung harness)."""

    def __init__(self, *a, delay: float, **kw):
        super().__init__(*a, **kw)
        self.delay = delay

    async def run(self, turn_input):
        await asyncio.sleep(self.delay)
        return await super().run(turn_input)


class ShortTimeoutLifecycle(LifecycleClient):
    """Creates one chosen rollout with a much shorter endpoint timeout than asked
    for, so that the endpoint's sweeper, not the client's deadline, ends it."""

    def __init__(self, *a, short: tuple[str, int], short_s: float, **kw):
        super().__init__(*a, **kw)
        self.short, self.short_s, self.timeouts = short, short_s, {}

    async def create(self, task_id, group_id=None, metadata=None, timeout_s=None, **kw):
        if (task_id, (metadata or {}).get("attempt")) == self.short:
            timeout_s = self.short_s
        self.timeouts[(task_id, (metadata or {}).get("attempt"))] = timeout_s
        return await super().create(task_id, group_id=group_id, metadata=metadata,
                                    timeout_s=timeout_s, **kw)


@pytest.mark.full  # a fault test: waits out a hung rollout's deadline
def test_step_survives_a_raising_a_hung_and_a_swept_rollout(served, tmp_path):
    """One RL step of 2 tasks x 4 attempts: task 0's first run raises out of the
    harness, its second hangs past the client's deadline; task 1 attempt 0's
    rollout is ended by the endpoint's sweeper (short timeout_s) before its model
    call. The step completes; those three are infra_error / timed_out / timed_out,
    counted, never trained; the other five train."""
    task0, task1 = (t.task_id for t in LengthParityEnv().sample_tasks(2, seed=0))
    made = collections.Counter()

    def make(env, task, client, model):
        made[task.task_id] += 1
        kw = dict(max_steps=1, sampling={"temperature": 1.0, "max_tokens": 6})
        if task.task_id == task0 and made[task0] == 1:
            raise RuntimeError("harness exploded")
        if task.task_id == task0 and made[task0] == 2:
            return SlowOrchestrator(env, task, client, model, delay=60.0, **kw)
        if task.task_id == task1:  # within the deadline, but past the swept one's timeout
            return SlowOrchestrator(env, task, client, model, delay=1.0, **kw)
        return _make(env, task, client, model)

    store = TraceStore(str(tmp_path / "rollouts.jsonl"))

    async def go():
        lc = ShortTimeoutLifecycle(served["url"], ADMIN, short=(task1, 0), short_s=0.3)
        collector = EndpointCollector(lc, LengthParityEnv(), make, "tiny", store, tasks_per_step=2,
                                      attempts_per_task=4, seed=0, concurrency=8,
                                      infra_retries=0, rollout_deadline_s=15.0)
        trainer = RLTrainer(_model(served["tok"].vocab_size), collector,
                            _config(1, concurrency=8), str(tmp_path / "run"), make_step=STEPS)
        try:
            return await asyncio.wait_for(trainer.run(), 120), trainer, lc
        finally:
            trainer.close()
            await lc.aclose()

    history, trainer, lc = asyncio.run(go())
    traces = store.load()
    assert len(history) == 1 and history[0]["rl_step"] == 0 and len(traces) == 8
    status = collections.Counter(t.status for t in traces)
    assert status == {"finished": 5, "infra_error": 1, "timed_out": 2}, [
        (t.task_id, t.attempt_id, t.status, t.metadata.get("artifacts")) for t in traces]
    (raised,) = [t for t in traces if t.status == "infra_error"]
    assert raised.task_id == task0 and "harness exploded" in raised.metadata["artifacts"]["error"]
    hung = [t for t in traces if t.status == "timed_out" and t.task_id == task0]
    swept = [t for t in traces if t.status == "timed_out" and t.task_id == task1]
    assert len(hung) == 1 and len(swept) == 1 and swept[0].attempt_id == "0"
    # The client's deadline cancelled it; its finish may find the endpoint's sweeper
    # already ended it (same timeout, started a moment earlier): timed_out either way.
    # The deadline went to the endpoint as every rollout's timeout (but the swept one's).
    assert lc.timeouts.pop((task1, 0)) == 0.3
    assert set(lc.timeouts.values()) == {15.0}
    m = history[0]
    assert m["infra_errors"] == 1 and m["timed_out"] == 2 and m["dropped_timed_out"] == 2
    assert m["finished"] == 5
    kept, _, _ = select_traces(traces, 0, trainer.config.batch)
    assert len(kept) == 5 and all(t.status == "finished" for t in kept)


def test_trainer_refuses_a_collector_configured_unlike_its_config(tmp_path):
    store = TraceStore(str(tmp_path / "r.jsonl"))
    for kw, name in ((dict(tasks_per_step=3), "tasks_per_step"),
                     (dict(attempts_per_task=2), "attempts_per_task"),
                     (dict(concurrency=4), "concurrency")):
        args = {**dict(tasks_per_step=2, attempts_per_task=4, concurrency=64), **kw}
        c = EndpointCollector(None, LengthParityEnv(), _make, "tiny", store, **args)
        with pytest.raises(ValueError, match=f"RLConfig.{name}="):
            RLTrainer(_model(64), c, _config(1), str(tmp_path / name))


def test_lifecycle_calls_are_retried_on_connection_errors_and_5xx(served, tmp_path):
    dead = refused_url()  # a port nothing listens on
    answers = iter([500, 503, 200])
    seen = []

    def handler(request):
        seen.append(request.url.path)
        code = next(answers)
        return httpx.Response(code, json={"rollout_id": "r1"} if code == 200 else {})

    async def go():
        lc = LifecycleClient(dead, ADMIN, retries=2, backoff_s=0.01)
        with pytest.raises(httpx.ConnectError):
            await lc.create("t")
        assert lc.calls == 3  # 1 try + 2 retries
        await lc.aclose()
        lc = LifecycleClient("http://x", ADMIN, retries=2, backoff_s=0.01)
        lc._http = httpx.AsyncClient(base_url="http://x", transport=httpx.MockTransport(handler))
        assert (await lc.create("t"))["rollout_id"] == "r1"  # 500, 503, then fine
        assert lc.calls == 3
        lc.retries, lc.calls = 2, 0
        answers_4xx = iter([404])
        lc._http = httpx.AsyncClient(base_url="http://x", transport=httpx.MockTransport(
            lambda r: httpx.Response(next(answers_4xx), json={})))
        with pytest.raises(Exception) as e:  # 4xx is final: no retry
            await lc.get("nope")
        assert getattr(e.value, "status_code", None) == 404 and lc.calls == 1
        await lc.aclose()

    asyncio.run(go())


@pytest.mark.full  # a run in a child process, killed and resumed
def test_killed_run_resumes_without_repeating_or_losing_rollouts(tmp_path):
    """SIGKILL a real RL process mid-collection of step 1, restart it, check the rollouts."""
    import signal
    import subprocess
    import sys
    import time

    tests = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    worker = os.path.join(tests, "support", "rl_kill_worker.py")
    workdir = str(tmp_path / "run")
    store = TraceStore(os.path.join(workdir, "rollouts.jsonl"))
    proc = subprocess.Popen([sys.executable, worker, workdir, "3", "8"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    deadline = time.time() + 300
    try:  # wait until step 0 is trained and step 1 is being collected (one rollout at a time)
        while time.time() < deadline:
            done = [t for t in store.read(on_error="skip") if t.metadata.get("rl_step") == 1]
            if 1 <= len(done) < 8 and os.path.exists(os.path.join(workdir, "checkpoints", "1")):
                break
            assert proc.poll() is None, "the worker ended before it could be killed"
            time.sleep(0.05)
        else:
            raise AssertionError("step 1 never started")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before_kill = store.load(on_error="skip")
    out = subprocess.run([sys.executable, worker, workdir, "2"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "start_step=1" in out.stdout and "trained rl_step=1" in out.stdout
    assert "trained rl_step=0" not in out.stdout  # step 0 was not trained again
    after = store.load(on_error="skip")
    keys = [(t.metadata["rl_step"], t.task_id, t.metadata["attempt"]) for t in after]
    assert len(keys) == len(set(keys)) == 2 * 2 * 4  # nothing repeated, nothing lost
    # Rollouts finished before the kill were kept as they were, not collected again.
    kept = {(t.metadata["rl_step"], t.task_id, t.metadata["attempt"]): t.metadata["rollout_id"]
            for t in before_kill}
    assert 8 < len(kept) < 16
    again = [k for k, t in zip(keys, after) if k in kept and t.metadata["rollout_id"] != kept[k]]
    assert not again, f"collected again after the restart: {again}"


def test_async_with_zero_staleness_and_drop_is_refused():
    """Async traces lag one version: max_staleness=0 with stale='drop' silently dropped steps."""
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        RLConfig(mode="async", batch=BatchConfig(max_staleness=0, stale="drop"))
    RLConfig(mode="async", batch=BatchConfig(max_staleness=0, stale="downweight"))  # allowed
    RLConfig(mode="sync", batch=BatchConfig(max_staleness=0))


def test_resume_refuses_another_task_stream(tmp_path):
    """The checkpoint (RLTrainer's TrainerHooks.state_dict) holds what decides step s's
    tasks: a resume with another seed / tasks_per_step / attempts_per_task is named."""
    trainer = RLTrainer(_model(64), ReplayCollector([]), _config(1), str(tmp_path),
                        make_step=STEPS)
    asyncio.run(trainer.run())  # one loop step (nothing to train), checkpointed
    trainer.close()
    with pytest.raises(ValueError, match="seed: checkpoint 0, now 1"):
        RLTrainer(_model(64), ReplayCollector([]), dataclasses.replace(_config(2), seed=1),
                  str(tmp_path), make_step=STEPS)
    again = RLTrainer(_model(64), ReplayCollector([]), _config(2), str(tmp_path),
                      make_step=STEPS)
    again.close()
    assert again.start_step == 1


def test_publish_runs_off_the_event_loop(served, tmp_path):
    """Orbax save + sampler reload used to run on the event loop, stalling every rollout."""
    import threading

    released, seen = threading.Event(), []
    trainer = _learner(served, tmp_path)
    trainer.on_publish = lambda version: seen.append(released.wait(10))

    async def go():
        async def release():  # can only run while publish waits if the loop is free
            await asyncio.sleep(0.2)
            released.set()
        await asyncio.gather(trainer.run(), release())

    asyncio.run(go())
    trainer.close()
    assert seen == [True]


class _FakeRunCollector(EndpointCollector):
    """Runs no model: each trace records the domain that actually ran it."""

    async def _run(self, task, attempt, rl_step):
        self.ran.append((task.domain, task.task_id, attempt))
        return Trace(task_id=task.task_id, status="finished", reward=1.0,
                     metadata={"ran_domain": task.domain, "prompt": task.prompt})


def _mixed_collector(store, ran):
    from ac2_jax.envs import CalculatorEnv, DomainMixer
    mix = DomainMixer({"a": CalculatorEnv(), "b": CalculatorEnv()})
    c = _FakeRunCollector(None, mix, _make, "tiny", store, tasks_per_step=16,
                          attempts_per_task=2, seed=0)
    c.ran = ran
    return c


def test_mixed_domains_of_one_env_class_group_and_resume_apart(tmp_path):
    """Issue 20: same-class domains shared task ids, so groups and resumed traces crossed."""
    store = TraceStore(str(tmp_path / "rollouts.jsonl"))
    ran = []
    c = _mixed_collector(store, ran)
    assert {t.domain for t in c.tasks(0)} == {"a", "b"}
    traces = asyncio.run(c.collect(0))
    groups = collections.defaultdict(set)
    for t in traces:
        groups[t.group_id].add(t.metadata["domain"])
        assert t.metadata["ran_domain"] == t.metadata["domain"]
    assert len(groups) == 16 and all(len(d) == 1 for d in groups.values())
    # Resume: a new collector on the same store reuses each domain's own traces.
    ran2 = []
    c2 = _mixed_collector(store, ran2)
    again = asyncio.run(c2.collect(0))
    assert ran2 == []
    for t in again:
        assert t.metadata["ran_domain"] == t.metadata["domain"] == t.task_id.split("/")[0]
    assert sorted((t.task_id, t.attempt_id) for t in again) == sorted(
        (t.task_id, t.attempt_id) for t in traces)
    by_id = {(t.task_id, t.attempt_id): t.metadata["prompt"] for t in traces}
    assert all(by_id[(t.task_id, t.attempt_id)] == t.metadata["prompt"] for t in again)


def test_duplicate_task_ids_in_a_step_are_refused(tmp_path):
    class DupEnv(LengthParityEnv):
        def sample_tasks(self, n, seed, split="train"):
            return [Task(task_id="same", prompt=f"p{i}") for i in range(n)]

    c = _FakeRunCollector(None, DupEnv(), _make, "tiny", TraceStore(str(tmp_path / "r.jsonl")),
                          tasks_per_step=2, attempts_per_task=2, seed=0)
    c.ran = []
    with pytest.raises(ValueError, match="duplicate task id"):
        asyncio.run(c.collect(0))
    assert c.ran == []


def _collect_step0(served, store, *, tasks, attempts, seed):
    """RL step 0 of LengthParityEnv collected over the served endpoint into `store`:
    (the event loop's thread id, the traces)."""
    async def go():
        lc = LifecycleClient(served["url"], ADMIN)
        try:
            got = await EndpointCollector(lc, LengthParityEnv(), _make, "tiny", store,
                                          tasks_per_step=tasks, attempts_per_task=attempts,
                                          seed=seed).collect(0)
        finally:
            await lc.aclose()
        return threading.get_ident(), got

    return asyncio.run(go())


class _ThreadRecordingStore(TraceStore):
    """A TraceStore that notes which thread each append ran on."""

    def __init__(self, path):
        super().__init__(path)
        self.threads = set()

    def append(self, trace):
        self.threads.add(threading.get_ident())
        super().append(trace)


def test_the_collector_stores_each_rollout_off_the_event_loop(served, tmp_path):
    """Each rollout is appended (flushed and fsynced) to the store in a worker
    thread before collect returns it: on the event loop, every fsync stalled all
    the other rollouts' requests."""
    store = _ThreadRecordingStore(str(tmp_path / "collected.jsonl"))
    loop_thread, got = _collect_step0(served, store, tasks=2, attempts=2, seed=0)
    assert sorted(t.key for t in store) == sorted(t.key for t in got) and len(got) == 4
    assert store.threads and loop_thread not in store.threads


# Its traces' log-probs are not these weights' (made up, or relabelled as sampled by
# each step's policy): the drift alarm fires by design (issue 65).
@pytest.mark.alarms_expected("drift")
@pytest.mark.parametrize("seq_len,grad_accum,ahead", [(128, 1, False), (64, 4, True)])
def test_six_rl_steps_of_varied_batches_compile_the_step_once(served, tmp_path, seq_len,
                                                               grad_accum, ahead, monkeypatch):
    """Steps of 3-8 traces of varied lengths and rewards, inside the batch's
    static capacity (rows x seq_len): `compiled_steps` stays at its warm-up
    value 1, and so does the jitted step's own executable cache (a count).
    With `compile_ahead` the step is compiled during the first collection
    (`warmup_step`), for the same geometry. With 64-token rows the traces (28-33
    tokens) need from 2 rows to all 8: run as 4 micro-batches of 2 rows
    (`RLConfig.grad_accum`), the step skips the empty ones, and how many it skips
    varies from step to step."""
    store = TraceStore(str(tmp_path / "collected.jsonl"))
    _, got = _collect_step0(served, store, tasks=6, attempts=4, seed=7)
    pool = [t for t in got if t.status == "finished"]
    rng = np.random.default_rng(0)
    steps = []
    for step in range(6):
        picked = [pool[i] for i in rng.choice(len(pool), int(rng.integers(3, 9)), replace=False)]
        replay = []
        for t in picked:
            t = Trace.from_dict(t.to_dict())  # a copy, tagged as sampled by this step's policy
            t.metadata["rl_step"] = step
            t.task_id = f"{t.task_id}-s{step}"
            # Rewards by attempt parity, not by the sampled text: which steps have a
            # reward spread (and train) must not depend on what the sampler wrote.
            t.reward = float(int(t.attempt_id) % 2)
            for e in t.episodes:
                for c in e.completions:
                    c.policy_version = step
            replay.append(t)
        steps.append(replay)
    assert len({sum(len(e.completions) for t in s for e in t.episodes) for s in steps}) > 1
    assert max(len(e.token_ids) for t in pool for e in t.episodes) <= seq_len  # rows never grow
    warmups = []
    real_warmup = RLTrainer.warmup_step
    monkeypatch.setattr(RLTrainer, "warmup_step",
                        lambda self: warmups.append(1) or real_warmup(self))
    config = dataclasses.replace(_config(6), grad_accum=grad_accum, compile_ahead=ahead,
                                 batch=BatchConfig(seq_len=seq_len, rows=8))
    trainer = RLTrainer(_model(served["tok"].vocab_size),
                        ReplayCollector([t for s in steps for t in s]), config,
                        str(tmp_path / "run"))
    history = asyncio.run(trainer.run())
    trainer.close()
    trained = [h for h in history if h["skipped_update"] == 0.0]  # equal rewards: no update
    assert len(history) == 6 and len(trained) >= 4
    assert [h["compiled_steps"] for h in trained] == [1.0] * len(trained)
    assert [h["batch_rows"] for h in trained] == [8.0] * len(trained)
    assert trainer.trainer.step_fn._step._cache_size() == 1
    assert len(warmups) == int(ahead)
    # What run() compiles ahead is the trained geometry: warming up again adds none.
    assert trainer.warmup_step() is True and trainer.trainer.compiled_steps == 1
    skipped = [h["micro_batches_skipped"] for h in trained]
    if grad_accum == 1:
        assert skipped == [0.0] * len(trained)
    else:
        assert len(set(skipped)) > 1 and max(skipped) < grad_accum, skipped


class KindEnv(AlternatingEnv):
    """Deterministic rewards by task kind: "solved" 1, "unsolved" 0, "mixed": the
    k-th verification of a task gives k % 2 (so G >= 2 attempts always differ).
    `calls`: the kinds each successive sample_tasks call returns (None: all `kind`)."""

    def __init__(self, calls=None, kind="mixed"):
        super().__init__()
        self.calls, self.kind, self.n = list(calls or []), kind, 0

    def sample_tasks(self, n, seed, split="train"):
        kinds = self.calls[self.n] if self.calls else [self.kind] * n
        assert len(kinds) == n, f"call {self.n} asked for {n} tasks, the script has {kinds}"
        self.n += 1
        return [Task(task_id=f"{k}-{self.n}-{i}", prompt=f"Say something ({k}).",
                     metadata={"kind": k}) for i, k in enumerate(kinds)]

    def verify(self, task, answer):
        kind = task.metadata["kind"]
        if kind == "mixed":
            return super().verify(task, answer)
        return float(kind == "solved")


def test_a_step_whose_groups_all_tie_changes_no_weight(served, tmp_path):
    """What the smoke test met 1 time in 64, made certain: every attempt is solved, so
    both groups tie (advantage 0). The step is skipped but still counts: logged,
    checkpointed as done (a restart starts at step 1), its traces stored; no weight
    changes and the policy version stays 0. The loop publishes the version it has
    once, so the sampler serves the learner's weights: here version 0, unchanged."""
    workdir = str(tmp_path / "run")
    store = TraceStore(str(tmp_path / "rollouts.jsonl"))
    published = []

    async def go():
        lc = LifecycleClient(served["url"], ADMIN)
        collector = EndpointCollector(lc, KindEnv(kind="solved"), _make, "tiny", store,
                                      tasks_per_step=2, attempts_per_task=4, seed=0)
        trainer = RLTrainer(_model(served["tok"].vocab_size), collector, _config(1), workdir,
                            on_publish=published.append, make_step=STEPS)
        before = _params(trainer)
        try:
            return before, await trainer.run(), _params(trainer), trainer.version
        finally:
            trainer.close()
            await lc.aclose()

    before, (m,), after, version = asyncio.run(go())
    assert m["skipped_update"] == 1.0 and m["zero_advantage_groups"] == 2.0
    assert m["traces"] == 8.0 and m["reward_mean"] == 1.0 and m["adv_abs_mean"] == 0.0
    assert "loss" not in m and m["policy_version"] == version == 0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)
    assert published == [0] and latest_published(os.path.join(workdir, "published")) == 0
    assert len(store.load()) == 8
    restarted = RLTrainer(_model(served["tok"].vocab_size), ReplayCollector([]), _config(1),
                          workdir, make_step=STEPS)
    assert restarted.start_step == 1 and restarted.version == 0
    restarted.close()
    rows = read_metrics(os.path.join(workdir, "metrics", "metrics.jsonl"))
    assert [(r["step"], r["train/skipped_update"]) for r in rows] == [(1, 1.0)]


@pytest.mark.parametrize("normalize_std", [False, True])
def test_tied_rewards_fp32_cannot_hold_move_no_parameter(tmp_path, normalize_std):
    """Issue 61, finding 1, on the real train step: 2 tasks x 8 attempts, every reward
    0.7 (which fp32 cannot hold; its fp32 group mean left advantages of ~6e-8, or
    +-0.06 of one sign per group with normalize_std, and AdamW stepped on it). Both
    groups are counted as tied, every advantage is exactly 0, and no parameter moves."""
    from tests.support.rl_traces import rl_trace
    traces = [rl_trace(task, a, 0.7, n_out=4) for task in ("a", "b") for a in range(8)]
    config = dataclasses.replace(_config(1), attempts_per_task=8,
                                 batch=BatchConfig(seq_len=128, rows=8,
                                                   normalize_std=normalize_std))
    trainer = RLTrainer(_model(64), ReplayCollector(traces), config, str(tmp_path),
                        make_step=STEPS)
    before = _params(trainer)
    (m,) = asyncio.run(trainer.run())
    after = _params(trainer)
    trainer.close()
    assert m["zero_advantage_groups"] == 2.0
    assert m["adv_abs_mean"] == 0.0 and m["adv_std"] == 0.0
    assert m["skipped_update"] == 1.0 and "loss" not in m and m["policy_version"] == 0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)


def test_dynamic_sampling_refills_zero_advantage_groups_and_counts_them(served, tmp_path):
    """Step of 2 tasks x 4 attempts: one always solved, one mixed -> one informative
    group; refill 1 brings an unsolved task (still one), refill 2 a mixed one (two)."""
    env = KindEnv([["solved", "mixed"], ["unsolved"], ["mixed"]])
    store = TraceStore(str(tmp_path / "rollouts.jsonl"))
    config = dataclasses.replace(_config(1), dynamic_sampling=True, max_refills=2)

    async def go():
        lc = LifecycleClient(served["url"], ADMIN)
        collector = EndpointCollector(lc, env, _make, "tiny", store, tasks_per_step=2,
                                      attempts_per_task=4, seed=0)
        trainer = RLTrainer(_model(served["tok"].vocab_size), collector, config,
                            str(tmp_path / "run"), make_step=STEPS)
        try:
            return await trainer.run()
        finally:
            trainer.close()
            await lc.aclose()

    (m,) = asyncio.run(go())
    assert (m["refills"], m["refill_tasks"], m["refill_repeats"]) == (2.0, 2.0, 0.0)
    assert m["informative_groups"] == 2.0 and m["zero_advantage_groups"] == 2.0
    assert m["dropped_zero_advantage"] == 8.0 and m["traces"] == 16.0
    # agent_error: the random policy may leave a bad <tool_call> (the verifier still rewards it).
    assert m["finished"] + m["agent_errors"] == 16.0 and m["skipped_update"] == 0.0
    assert m["reward_mean"] == pytest.approx(0.5)  # (4 + 2 + 0 + 2) / 16, every trace counted
    stored = store.load()
    assert collections.Counter(t.metadata["refill"] for t in stored) == {0: 8, 1: 4, 2: 4}
    kinds = {t.task_id.split("-")[0] for t in stored if t.metadata["refill"] == 2}
    assert kinds == {"mixed"}
    with pytest.raises(ValueError, match="dynamic_sampling needs a collector with refill"):
        RLTrainer(_model(64), ReplayCollector([]), config, str(tmp_path / "replay"))
    with pytest.raises(ValueError, match="max_refills"):
        RLConfig(max_refills=-1)


def test_adaptive_mixer_is_fed_each_step_logged_and_replayed_on_resume(served, tmp_path):
    from ac2_jax.envs import AdaptiveMix, DomainMixer

    def mixer():
        return DomainMixer({"easy": KindEnv(kind="solved"), "half": KindEnv(kind="mixed")},
                           adaptive=AdaptiveMix(window=8, floor=0.1, min_results=2))

    workdir, store = str(tmp_path / "run"), TraceStore(str(tmp_path / "run" / "rollouts.jsonl"))
    config = RLConfig(steps=1, tasks_per_step=4, attempts_per_task=2,
                      batch=BatchConfig(seq_len=128, rows=8),
                      optimizer=OptimizerConfig(learning_rate=1e-2))

    async def go():
        lc = LifecycleClient(served["url"], ADMIN)
        mix = mixer()
        collector = EndpointCollector(lc, mix, _make, "tiny", store, tasks_per_step=4,
                                      attempts_per_task=2, seed=0)
        trainer = RLTrainer(_model(served["tok"].vocab_size), collector, config, workdir,
                            make_step=STEPS)
        try:
            return await trainer.run(), mix, trainer
        finally:
            trainer.close()
            await lc.aclose()

    (m,), mix, trainer = asyncio.run(go())
    assert trainer.mixer is mix
    per_domain = collections.Counter(t.metadata["domain"] for t in store.load())
    assert per_domain["easy"] >= 2 and per_domain["half"] >= 2  # seed 0 draws both
    assert m["mix_results/easy"] == per_domain["easy"] and m["mix_pass_rate/easy"] == 1.0
    assert m["mix_pass_rate/half"] == 0.5
    # easy: always solved -> its floor share 0.1 x 0.5; half takes the rest.
    assert m["mix_weight/easy"] == pytest.approx(0.05)
    assert m["mix_weight/half"] == pytest.approx(0.95)
    rows = read_metrics(os.path.join(workdir, "metrics", "metrics.jsonl"))
    assert rows[0]["train/mix_weight/easy"] == pytest.approx(0.05)
    # A restarted run replays the stored step into a fresh mixer: same state, same next tasks.
    again = mixer()
    collector = EndpointCollector(None, again, _make, "tiny", store, tasks_per_step=4,
                                  attempts_per_task=2, seed=0)
    resumed = RLTrainer(_model(served["tok"].vocab_size), collector, config, workdir,
                        make_step=STEPS)
    resumed.close()
    assert resumed.start_step == 1 and again.state() == mix.state()
    assert again.current_weights() == mix.current_weights()
    assert [t.domain for t in again.sample_tasks(8, 1)] == [t.domain for t in mix.sample_tasks(8, 1)]


def test_refill_leaves_out_tasks_the_step_already_ran_and_counts_them(tmp_path):
    class FixedPoolEnv(LengthParityEnv):  # the same ids whatever the seed: refills repeat tasks
        def sample_tasks(self, n, seed, split="train"):
            return [Task(task_id=f"t{i}", prompt=f"p{i}") for i in range(n)]

    c = _FakeRunCollector(None, FixedPoolEnv(), _make, "tiny",
                          TraceStore(str(tmp_path / "r.jsonl")), tasks_per_step=2,
                          attempts_per_task=2, seed=0)
    c.ran = []
    with pytest.raises(ValueError, match="call collect"):
        asyncio.run(c.refill(0, 1, 2))
    first = asyncio.run(c.collect(0))
    more, repeated = asyncio.run(c.refill(0, 1, 3))  # t0, t1 ran already; t2 is new
    assert len(first) == 4 and repeated == 2
    assert {(t.task_id, t.metadata["refill"]) for t in more} == {("t2", 1)}
    assert len(c.ran) == 6


def _compacting_replay():
    """2 tasks x 4 attempts of main -> compactor -> main, one judged compaction each
    (memo_ok on even attempts); reward = attempt parity. Token ids fit a 64-token vocab."""
    from ac2_jax.trace import Completion, TraceRecorder
    traces = []
    for g in range(2):
        for a in range(4):
            event = {"agent": "compactor", "kind": "compaction", "memo": "m", "memo_ok": a % 2 == 0}
            t = Trace(task_id=f"task{g}", attempt_id=str(a), group_id=f"0:task{g}",
                      reward=float(a % 2), status="finished",
                      metadata={"rl_step": 0, "artifacts": {"events": [event]}})
            rec = TraceRecorder(t)
            for k, agent in enumerate(["main", "compactor", "main"]):
                out = [10 + 8 * k + a + g + i for i in range(2 + k)]
                rec.record(agent, Completion([1 + k, 2, 3], out, [-1.0] * len(out)))
            traces.append(t)
    return traces


# Its traces' log-probs are not these weights' (made up, or relabelled as sampled by
# each step's policy): the drift alarm fires by design (issue 65).
@pytest.mark.alarms_expected("drift")
def test_step_log_has_per_agent_metrics_and_main_only_trains_no_compactor_token(tmp_path):
    """train_agents=("main",): compactor tokens are generated (agent_tokens/compactor) but
    not trained (trained_tokens/compactor 0, counted as excluded); the step's compactions,
    memo fidelity and staleness histogram reach train/ in metrics.jsonl."""
    traces = _compacting_replay()
    tokens = collections.Counter()
    for t in traces:
        for e in t.episodes:
            tokens[e.agent] += e.num_agent_tokens
    config = dataclasses.replace(_config(1), batch=BatchConfig(seq_len=128, rows=8,
                                                               train_agents=("main",)))
    trainer = RLTrainer(_model(64), ReplayCollector(traces), config, str(tmp_path),
                        make_step=STEPS)
    (m,) = asyncio.run(trainer.run())
    trainer.close()
    assert m["skipped_update"] == 0.0
    assert m["agent_tokens/compactor"] == tokens["compactor"] > 0
    assert m["agent_tokens/main"] == m["trained_tokens/main"] == tokens["main"]
    assert m["trained_tokens/compactor"] == 0 and m["excluded_episodes"] == 8
    assert m["excluded_agent_tokens"] == tokens["compactor"]
    assert m["episodes/main"] == 2.0 and m["episodes/compactor"] == 1.0
    assert m["compactions_per_attempt"] == 1.0 and m["memos_judged"] == 8.0
    assert m["memo_fidelity"] == 0.5 and m["staleness_hist/0"] == 8.0
    row = read_metrics(str(tmp_path / "metrics" / "metrics.jsonl"))[-1]
    for k in ("trained_tokens/main", "trained_tokens/compactor", "memo_fidelity",
              "staleness_hist/0", "agent_tokens/compactor", "excluded_episodes"):
        assert row[f"train/{k}"] == m[k]


def test_a_failing_compile_ahead_is_logged_and_the_step_still_trains(tmp_path, monkeypatch,
                                                                     caplog):
    """Compiling ahead is an optimisation: when it raises, the run logs it and the
    first update compiles the step itself (the loop neither stops nor stalls)."""
    from ac2_jax.training import Trainer

    def broken(self, *a, **k):
        raise RuntimeError("out of host memory while compiling")

    monkeypatch.setattr(Trainer, "warmup", broken)
    config = dataclasses.replace(_config(1), compile_ahead=True)
    trainer = RLTrainer(_model(64), ReplayCollector(_compacting_replay()), config,
                        str(tmp_path), make_step=STEPS)
    with caplog.at_level("ERROR"):
        (m,) = asyncio.run(trainer.run())
    trainer.close()
    assert m["skipped_update"] == 0.0 and m["compiled_steps"] == 1.0
    assert "compiling the train step ahead failed" in caplog.text


def test_each_rl_attempt_samples_with_its_own_fixed_seed(served):
    """Unseeded RL requests took the sampler's next seed in arrival order (timing), so
    no two runs sampled alike (issue 32 finding 7). Each attempt now carries
    rl_attempt_seed(seed, step, task, attempt); two collections of a step sample
    the same tokens whatever order their requests arrive in."""
    from ac2_jax.seeds import rl_attempt_seed
    seen: dict = {}

    def recording(env, task, client, model):
        orch = _make(env, task, client, model)
        seen.setdefault(id(orch), orch)
        return orch

    async def collect(path, concurrency):
        lc = LifecycleClient(served["url"], ADMIN)
        try:
            c = EndpointCollector(lc, LengthParityEnv(), recording, "tiny", TraceStore(path),
                                  tasks_per_step=2, attempts_per_task=4, seed=3,
                                  concurrency=concurrency)
            return await c.collect(0)
        finally:
            await lc.aclose()

    tmp = served["tmp"]
    first = asyncio.run(collect(str(tmp / "seeded_a.jsonl"), 8))
    seeds = sorted(o.sampling["seed"] for o in seen.values())
    want = sorted(rl_attempt_seed(3, 0, t.task_id, int(t.attempt_id)) for t in first)
    assert seeds == want and len(set(seeds)) == 8
    again = asyncio.run(collect(str(tmp / "seeded_b.jsonl"), 1))  # one at a time: other batches
    tokens = [[e.token_ids for e in t.episodes] for t in first]
    assert tokens == [[e.token_ids for e in t.episodes] for t in again]
