"""Correctness alarms (issue 65): each alarm fires on its injected fault and stays
quiet on a healthy run.

- weights served = weights published: a sampler that skips a load (full weights
  or a LoRA adapter: verl #7495) serves another checksum than published; a sampler
  stuck on an old version past the deadline.
- sampler/learner drift: traces sampled by a real JaxSampler train a learner of
  the same weights (quiet) and of perturbed weights (fires, naming completions).
- hang watchdog: a stage that blocks fires (its line names the stage and the
  config key; every thread's stack is logged); in a process, "stop" exits non-zero.
- infra_error retries back off (capped, exponential, jittered) against a real
  refused endpoint, counted.
"""

import asyncio
import logging
import subprocess
import sys
import textwrap
import time

import jax
import pytest
from flax import nnx

from ac2_jax.envs import Task
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.models.io.params_io import publish_weights, published_checksum, weights_checksum
from ac2_jax.models.lora import LoRAConfig
from ac2_jax.orchestration import DefaultOrchestrator, LifecycleClient
from ac2_jax.sampling.base import SamplingParams
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.segments import SAMPLER_LOGPROBS
from ac2_jax.trace import Completion, Trace, TraceRecorder, TraceStore
from ac2_jax.training import OptimizerConfig, PolicyGradientLoss
from ac2_jax.training.core import MetricsLogger, StepCache, read_metrics
from ac2_jax.training.core.watchdog import Watchdog
from ac2_jax.training.rl.alarms import (
    AlarmConfig,
    Alarms,
    AlarmsConfig,
    AlarmStop,
    WeightsAlarmConfig,
    WeightsCheck,
)
from ac2_jax.training.rl.batching import pack_rl_batch
from ac2_jax.training.rl.collectors import EndpointCollector
from ac2_jax.training.rl.data import BatchConfig
from ac2_jax.training.rl.trainer import ReplayCollector, RLConfig, RLTrainer
from tests.support.ports import refused_url

pytestmark = pytest.mark.alarms_expected  # these tests fire alarms on purpose
STEPS = StepCache()
OPTIMIZER = OptimizerConfig(learning_rate=1e-3)
GRAD_ACCUM = 2
VOCAB = 64


def _cfg(lora=None):
    return DecoderConfig.tiny(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                              num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                              max_position_embeddings=64, lora=lora)


def _perturbed(model, scale, seed=1):
    """`model` with every published leaf moved by N(0, scale)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    moved = [x + scale * jax.random.normal(k, x.shape, x.dtype)
             for x, k in zip(leaves, keys, strict=True)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, moved), rest)


class SkippingSampler(JaxSampler):
    """Says it loaded a step and serves it as that version, but never reads it: the
    silent stale sampler (an adapter load dropped on the way, verl #7495)."""

    def load_weights(self, step=None):
        with self._load_lock:
            self._stage(int(step))
        return int(step)


def _sampler(model, publish_dir, cls=JaxSampler):
    return cls(model, publish_dir=publish_dir, max_context=64, max_batch=4, min_batch=4,
               min_cache_len=64, eos_token_ids=[VOCAB - 1], seed=0)


def test_weights_alarm_fires_on_a_sampler_that_skips_an_adapter_load(tmp_path):
    """A LoRA learner publishes its adapters alone (verl #7495's case); the full-weights
    case runs end to end through RLTrainer below."""
    lora = LoRAConfig(rank=2, alpha=4.0)
    base = Decoder(_cfg(lora), rngs=nnx.Rngs(0))
    learner = _perturbed(base, 0.05)  # version 1: the weights after an update
    publish_weights(learner, str(tmp_path), 1)
    published = published_checksum(str(tmp_path), 1)
    assert published == weights_checksum(learner) != weights_checksum(base)
    for cls, fires in ((JaxSampler, False), (SkippingSampler, True)):
        sampler = _sampler(Decoder(_cfg(lora), rngs=nnx.Rngs(0)), str(tmp_path), cls)
        try:
            assert sampler.load_weights(1) == 1 and sampler.policy_version == 1
            report = sampler.served_weights()
        finally:
            sampler.close()
        check = WeightsCheck(Alarms(AlarmsConfig()))
        check.published(1, published, now=0.0)
        if fires:
            with pytest.raises(AlarmStop, match=r"ALARM weights \(stop\): the sampler serves "
                               r"version 1 with checksum .* published .*alarms\.weights\."
                               r"action=off"):
                check.served(report, now=1.0, where="test sampler")
        else:
            check.served(report, now=1.0, where="test sampler")
            assert check.metrics()["alarms/weights_verified"] == 1


def test_weights_alarm_fires_on_a_sampler_stuck_on_an_old_version():
    check = WeightsCheck(Alarms(AlarmsConfig(weights=WeightsAlarmConfig(deadline_s=30.0))))
    check.published(1, "a" * 16, now=0.0)
    check.published(2, "b" * 16, now=100.0)
    old = {"version": 1, "checksum": "a" * 16}
    check.served(old, now=120.0, where="w")  # within the deadline: quiet
    assert check.alarms.fired == []
    with pytest.raises(AlarmStop, match="still serves version 1, 31s after version 2"):
        check.served(old, now=131.0, where="w")
    # a fleet: each backend is checked; an unreporting one is counted, not passed
    check = WeightsCheck(Alarms(AlarmsConfig()))
    check.published(2, "b" * 16, now=0.0)
    check.served({"version": 2, "members": [{"version": 2, "checksum": "b" * 16},
                                            {"version": 2, "checksum": None}]}, 1.0, "fleet")
    assert check.metrics() == {"alarms/weights_verified": 1.0,
                               "alarms/weights_unverified": 1.0,
                               "alarms/weights_mismatches": 0.0}


# ------------------------------------------------------------------ drift, end to end


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """8 completions a real JaxSampler drew from the version-0 model (its log-probs
    recorded), as traces of 2 tasks x 4 attempts with rewards that differ."""
    tmp = tmp_path_factory.mktemp("drift")
    model = Decoder(_cfg(), rngs=nnx.Rngs(0))
    sampler = _sampler(model, str(tmp / "unused"))

    async def draw():
        params = [SamplingParams(temperature=1.0, max_tokens=6, seed=i) for i in range(8)]
        return await asyncio.gather(*(sampler.generate([1, 2, 3, 4 + i % 2], p)
                                      for i, p in enumerate(params)))

    try:
        results = asyncio.run(draw())
    finally:
        sampler.close()
    traces = []
    for i, r in enumerate(results):
        t = Trace(task_id=f"t{i % 2}", attempt_id=str(i // 2), group_id=f"g:t{i % 2}",
                  reward=float(i // 2 % 2), status="finished", metadata={"rl_step": 0})
        TraceRecorder(t).record("main", Completion([1, 2, 3, 4 + i % 2], r.output_ids,
                                                   r.output_logprobs, policy_version=0))
        traces.append(t)
    return traces


def _trainer(model, traces, workdir, alarms, **kw):
    # grad_accum 2: the drift sums add over micro-batches (the step the test below shares).
    config = RLConfig(steps=1, tasks_per_step=2, attempts_per_task=4,
                      batch=BatchConfig(seq_len=32, rows=4), grad_accum=GRAD_ACCUM,
                      loss=PolicyGradientLoss(), optimizer=OPTIMIZER)
    return RLTrainer(model, ReplayCollector(traces), config, str(workdir), make_step=STEPS,
                     alarms=alarms, **kw)


def test_healthy_run_is_quiet_and_perturbed_weights_and_a_skipped_load_fire(sampled, tmp_path):
    """RLTrainer end to end. Healthy: the learner holds the weights that sampled the
    traces and the sampler loads each publish: drift ~0 (fp32), the served checksum
    matches, nothing fires. Faulty: the learner's weights perturbed (drift fires,
    naming the worst completions) and a sampler that skips the load (the weights
    alarm stops the run after the publish)."""
    runs = {}
    for name, scale, cls in (("ok", 0.0, JaxSampler), ("bad", 0.3, SkippingSampler)):
        work = tmp_path / name
        sampler = _sampler(Decoder(_cfg(), rngs=nnx.Rngs(0)), str(work / "published"), cls)
        trainer = _trainer(_perturbed(Decoder(_cfg(), rngs=nnx.Rngs(0)), scale), sampled, work,
                           AlarmsConfig(drift=AlarmConfig(threshold=1e-3)),
                           on_publish=sampler.load_weights, served_weights=sampler.served_weights,
                           publish_dir=str(work / "published"),
                           logger=MetricsLogger(str(work / "metrics"), console=False))
        try:
            runs[name] = asyncio.run(trainer.run())[0]
        except AlarmStop as e:
            runs[name] = e
        finally:
            trainer.close()
            sampler.close()
        runs[name + "_fired"] = trainer.alarms.fired
        # The healthy run's drift came from the step's own forward: no other was compiled.
        runs[name + "_extra_forward"] = trainer.step_fn._logprobs is not None
    m = runs["ok"]
    assert m["drift/onpolicy_tokens"] > 0 and m["drift/stale_tokens"] == 0
    assert m["drift/onpolicy_abs_mean"] < 1e-4 and abs(m["drift/onpolicy_kl"]) < 1e-6  # fp32
    assert runs["ok_extra_forward"] is False  # drift from the step's forward: no other one
    assert m["alarms/weights_verified"] == 1 and m["alarms/weights_mismatches"] == 0
    assert runs["ok_fired"] == [] and m["skipped_update"] == 0.0
    logged = read_metrics(str(tmp_path / "ok" / "metrics" / "metrics.jsonl"))[-1]
    assert logged["train/drift/onpolicy_abs_mean"] == pytest.approx(m["drift/onpolicy_abs_mean"])

    (d_name, drift), (w_name, line) = runs["bad_fired"]
    assert (d_name, w_name) == ("drift", "weights")
    assert isinstance(runs["bad"], AlarmStop) and str(runs["bad"]) == line
    assert drift.startswith("ALARM drift (warn): sampler/learner drift at the same weights")
    assert "worst completions by the updated learner: t" in drift
    assert "--config.alarms.drift.action=off" in drift
    assert line.startswith("ALARM weights (stop): the sampler serves version 1 with checksum")


# ------------------------------------------------------------------ hang watchdog


def test_watchdog_names_the_blocked_stage_and_logs_every_stack(caplog):
    fired = []
    with Watchdog(0.1, "stop", where="learner", poll_s=0.02, on_fire=fired.append) as dog:
        with dog.stage("fast"):
            pass
        with caplog.at_level(logging.ERROR, "ac2_jax.alarms"), dog.stage("train step"):
            time.sleep(0.5)  # blocks past the limit
    (line,) = fired
    assert "ALARM hang (stop): stage 'train step' of the learner made no progress" in line
    assert "--config.alarms.hang.action=off" in line
    stacks = "\n".join(r.getMessage() for r in caplog.records)
    assert "--- thread MainThread" in stacks and "time.sleep(0.5)" in stacks


def test_trainer_watchdog_fires_on_a_blocked_collection(tmp_path, caplog):
    class Blocking(ReplayCollector):
        async def collect(self, rl_step):
            await asyncio.sleep(0.6)
            return []

    trainer = RLTrainer(Decoder(_cfg(), rngs=nnx.Rngs(0)), Blocking([]),
                        RLConfig(steps=1, tasks_per_step=1, attempts_per_task=1), str(tmp_path),
                        alarms=AlarmsConfig(hang=AlarmConfig(threshold=0.2, action="warn")))
    try:
        with caplog.at_level(logging.WARNING, "ac2_jax.alarms"):
            asyncio.run(trainer.run())
    finally:
        trainer.close()
    assert any("ALARM hang (warn): stage 'collection' of the learner" in r.getMessage()
               for r in caplog.records)


@pytest.mark.full
def test_watchdog_stop_exits_the_process_non_zero():
    # watchdog.py imports only the standard library: loaded alone, the child starts in
    # milliseconds instead of importing jax through the package.
    path = sys.modules[Watchdog.__module__].__file__
    script = textwrap.dedent(f"""
        import importlib.util, time
        spec = importlib.util.spec_from_file_location("watchdog", {path!r})
        mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
        dog = mod.Watchdog(0.2, "stop", where="collector", poll_s=0.05)
        with dog.stage("collection"):
            time.sleep(30)
    """)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, env={"JAX_PLATFORMS": "cpu", **__import__("os").environ})
    assert out.returncode == 70 and time.perf_counter() - t0 < 25
    assert "stage 'collection' of the collector made no progress" in out.stderr
    assert 'File "<string>", line 7' in out.stderr  # the stuck thread's stack


# ------------------------------------------------------------------ infra backoff


def test_infra_retries_back_off_against_a_refused_endpoint(tmp_path):
    class OneTask:
        def sample_tasks(self, n, seed, split):
            return [Task(task_id="t0", prompt="p")]

    def make(env, task, client, model):
        return DefaultOrchestrator(env, task, client, model, max_steps=1)

    async def go():
        lc = LifecycleClient(refused_url(), "k", retries=0)
        try:
            col = EndpointCollector(lc, OneTask(), make, "m", TraceStore(str(tmp_path / "r")),
                                    tasks_per_step=1, attempts_per_task=1, infra_retries=3,
                                    infra_backoff_s=0.05, infra_backoff_max_s=0.08)
            t0 = time.perf_counter()
            (trace,) = await col.collect(0)
            return col, trace, time.perf_counter() - t0
        finally:
            await lc.aclose()

    col, trace, took = asyncio.run(go())
    assert trace.status == "infra_error" and trace.metadata["infra_retries"] == 3
    # waits: [0.025, 0.05], [0.04, 0.08], [0.04, 0.08] (the cap)
    assert col.backoff_sleeps == 3 and 0.105 <= col.backoff_s <= 0.21 and took >= col.backoff_s
    with pytest.raises(ValueError, match="infra_backoff_s <= infra_backoff_max_s"):
        EndpointCollector(None, OneTask(), make, "m", TraceStore(str(tmp_path / "s")),
                          tasks_per_step=1, attempts_per_task=1, infra_backoff_s=2.0,
                          infra_backoff_max_s=1.0)


def test_the_split_learner_reads_the_served_checksum_over_http(tmp_path):
    """The split job's learner reads what the endpoint serves from its admin /v1/models
    entry (`split.endpoint_weights`): a real FastAPI endpoint over a sampler that loads
    (verified) and one that skips the load (the weights alarm fires)."""
    from ac2_jax.serving.app import build_app
    from ac2_jax.serving.server import serve_in_thread
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
    from ac2_jax.training.rl.split import endpoint_weights

    tok = build_tiny_tokenizer(str(tmp_path / "tok"))
    cfg = _cfg().replace(vocab_size=tok.vocab_size)
    publish = str(tmp_path / "published")
    publish_weights(_perturbed(Decoder(cfg, rngs=nnx.Rngs(0)), 0.05), publish, 1)
    for cls, fires in ((JaxSampler, False), (SkippingSampler, True)):
        sampler = _sampler(Decoder(cfg, rngs=nnx.Rngs(0)), publish, cls)
        url, stop = serve_in_thread(build_app(sampler, tok, admin_key="sk-a", model_name="m"))

        async def served(url=url):
            lc = LifecycleClient(url, "sk-a")
            try:
                assert await lc.load_weights(1) == 1
                return await endpoint_weights(lc)
            finally:
                await lc.aclose()

        try:
            report = asyncio.run(served())
        finally:
            stop()
            sampler.close()
        check = WeightsCheck(Alarms(AlarmsConfig()))
        check.published(1, published_checksum(publish, 1), now=0.0)
        if fires:
            with pytest.raises(AlarmStop, match="serves version 1 with checksum"):
                check.served(report, 1.0, "endpoint")
        else:
            check.served(report, 1.0, "endpoint")
            assert report["version"] == 1 and check.verified == 1


def test_drift_from_the_steps_forward_equals_a_forward_before_the_update():
    """The drift sums a PolicyGradientLoss adds from its own forward
    (`objectives.drift_sums`, no extra forward) equal numpy's, from the learner's
    log-probs before the update (`TrainStep.logprobs` of the pre-update state), on a
    batch of on-policy and stale tokens, at lr > 0, with grad_accum 2 (sums over
    micro-batches). fp32, rtol 1e-5. The step is the RLTrainer runs' above (STEPS:
    no compile of its own when they ran first)."""
    import numpy as np

    from ac2_jax.training import create_train_state
    from ac2_jax.training.core.objectives import DRIFT_ONPOLICY
    from ac2_jax.training.rl import rl_segment

    rng = np.random.default_rng(0)
    segs = []
    for i in range(4):
        n = 10 + i
        mask = (np.arange(n) >= 4).astype(np.float32)
        segs.append(rl_segment(rng.integers(0, VOCAB - 1, n), mask,
                               np.where(mask > 0, rng.normal(-4.0, 1.0, n), 0.0),
                               task=f"t{i}", advantage=float(i % 2) - 0.5))
    batch = pack_rl_batch(segs, 32, BatchConfig(seq_len=32, rows=4))
    on = (rng.random(batch.tokens.shape) < 0.5).astype(np.float32)
    model = Decoder(_cfg(), rngs=nnx.Rngs(0))
    graphdef, state = create_train_state(model, OPTIMIZER)
    step = STEPS(graphdef, PolicyGradientLoss(), OPTIMIZER, mesh=None, grad_accum=GRAD_ACCUM,
                 donate=True)
    state = step.place(state)
    learner = np.asarray(step.logprobs(state, batch), np.float64)
    _, metrics = step(state, batch, {DRIFT_ONPOLICY: on})
    denom = float(np.asarray(batch.loss_mask).sum())
    d = learner - np.asarray(batch.feature(SAMPLER_LOGPROBS), np.float64)
    trained = np.asarray(batch.loss_mask) > 0
    for kind, sel in (("onpolicy", on > 0), ("stale", on == 0)):
        x = d[trained & sel]
        assert x.size > 0
        got_abs = float(metrics[f"_drift_{kind}_abs"]) * denom
        got_kl = float(metrics[f"_drift_{kind}_kl"]) * denom
        assert got_abs == pytest.approx(np.abs(x).sum(), rel=1e-5), kind
        assert got_kl == pytest.approx((np.exp(x) - 1 - x).sum(), rel=1e-5), kind
