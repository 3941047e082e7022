"""The in-memory weight hand-off (issue 66): a learner in the sampler's process gives
the embedded JaxSampler its params directly (`RLTrainer(hand_off=JaxSampler.set_params)`,
the RL recipe's default: `SamplerConfig.hand_off="memory"`) instead of an Orbax
publish that the sampler reloads. It must serve exactly what the disk route serves:
the same weights (bitwise, fp32), hence the same tokens and log-probs, the same
version and the same weights-alarm checksum; the folder is still published (in the
background) for other readers."""

import asyncio

import jax
import numpy as np
import pytest
from flax import nnx

from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.models.io.params_io import (
    assign_params,
    latest_published,
    load_published,
    publish_weights,
    published_checksum,
    published_params,
)
from ac2_jax.models.lora import LoRAConfig
from ac2_jax.sampling.base import SamplingParams
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.trace import Completion, Trace, TraceRecorder
from ac2_jax.training import OptimizerConfig, PolicyGradientLoss
from ac2_jax.training.core import StepCache
from ac2_jax.training.rl.data import BatchConfig
from ac2_jax.training.rl.trainer import ReplayCollector, RLConfig, RLTrainer

VOCAB = 64
PROMPTS = [[1, 2, 3, 4], [1, 2, 3, 5], [7, 8]]


def _cfg(vocab=VOCAB, **kw):
    return DecoderConfig.tiny(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        **kw,
    )


def _sampler(model, publish_dir=None):
    return JaxSampler(
        model,
        publish_dir=publish_dir,
        max_context=64,
        max_batch=4,
        min_batch=4,
        min_cache_len=64,
        eos_token_ids=[VOCAB - 1],
        seed=0,
    )


def _draw(sampler, n, max_tokens=6):
    async def go():
        params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=i) for i in range(n)]
        return await asyncio.gather(
            *(sampler.generate(PROMPTS[i % len(PROMPTS)], p) for i, p in enumerate(params))
        )

    return asyncio.run(go())


def _leaves(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _perturbed(model, scale, seed=1):
    """`model` with every Param leaf moved by N(0, scale) (numpy: nothing compiles)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    moved = [
        jax.numpy.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape), x.dtype)
        for x in leaves
    ]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, moved), rest)


@pytest.fixture(scope="module")
def traces():
    """8 completions the version-0 model sampled (log-probs recorded), as 2 tasks x 4
    attempts whose rewards differ within each group (every group has an advantage)."""
    sampler = _sampler(Decoder(_cfg(), rngs=nnx.Rngs(0)))
    try:
        results = _draw(sampler, 8)
    finally:
        sampler.close()
    out = []
    for i, r in enumerate(results):
        t = Trace(
            task_id=f"t{i % 2}",
            attempt_id=str(i // 2),
            group_id=f"g:t{i % 2}",
            reward=float(i // 2 % 2),
            status="finished",
            metadata={"rl_step": 0},
        )
        TraceRecorder(t).record(
            "main",
            Completion(
                PROMPTS[i % len(PROMPTS)], r.output_ids, r.output_logprobs, policy_version=0
            ),
        )
        out.append(t)
    return out


@pytest.mark.full  # ~8 s of CPU: the train step's compile and two samplers
def test_one_rl_step_in_memory_serves_what_the_disk_publish_serves(traces, tmp_path):
    """One RLTrainer step hands the update to `memory` in memory and publishes it to the
    folder `disk` reloads (on_publish, after the background write): both then hold the
    same weights bitwise, sample the same tokens with equal log-probs (fp32, bitwise:
    tolerance 0), at the same version, with the published checksum."""
    publish = str(tmp_path / "published")
    memory = _sampler(Decoder(_cfg(), rngs=nnx.Rngs(0)))  # no publish_dir: memory only
    disk = _sampler(Decoder(_cfg(), rngs=nnx.Rngs(0)), publish)
    config = RLConfig(
        steps=1,
        tasks_per_step=2,
        attempts_per_task=4,
        batch=BatchConfig(seq_len=32, rows=4),
        loss=PolicyGradientLoss(),
        optimizer=OptimizerConfig(learning_rate=1e-2),
    )
    trainer = RLTrainer(
        Decoder(_cfg(), rngs=nnx.Rngs(0)),
        ReplayCollector(traces),
        config,
        str(tmp_path / "run"),
        make_step=StepCache(),
        publish_dir=publish,
        hand_off=memory.set_params,
        on_publish=disk.load_weights,
        served_weights=memory.served_weights,
    )
    try:
        before = _leaves(trainer.model())
        (m,) = asyncio.run(trainer.run())
        learner = _leaves(trainer.model())
        # The version bookkeeping: one update, version 1 everywhere, the alarm satisfied.
        assert m["skipped_update"] == 0.0 and m["policy_version"] == 1 == trainer.version
        assert m["alarms/weights_verified"] == 1 and m["alarms/weights_mismatches"] == 0
        assert memory.policy_version == disk.policy_version == 1
        assert latest_published(publish) == 1  # the background write finished with run()
        served = memory.served_weights()
        assert served["version"] == 1 and served["checksum"] == published_checksum(publish, 1)
        assert disk.served_weights()["checksum"] == served["checksum"]
        # The weights: the learner's, bitwise, in both samplers; they moved.
        assert max(float(np.abs(a - b).max()) for a, b in zip(before, learner, strict=True)) > 0
        for a, b, c in zip(_leaves(memory._model), _leaves(disk._model), learner, strict=True):
            assert a.dtype == b.dtype == np.float32
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a, c)
        # What they sample: equal tokens and log-probs, each token at version 1.
        got_memory, got_disk = _draw(memory, 4), _draw(disk, 4)
        for a, b in zip(got_memory, got_disk, strict=True):
            assert a.output_ids == b.output_ids and a.policy_version == b.policy_version == 1
            np.testing.assert_array_equal(a.output_logprobs, b.output_logprobs)
            assert a.token_versions() == [1] * len(a.output_ids)
    finally:
        trainer.close()
        memory.close()
        disk.close()


LORA = LoRAConfig(rank=2, alpha=4.0)


@pytest.mark.parametrize(
    "learner_cfg, sampler_cfg",
    [
        pytest.param(_cfg(lora=LORA), _cfg(lora=LORA), id="lora"),
        # Each further config is one more Decoder init compile (~1.5 s of CPU): full tier.
        pytest.param(
            _cfg(), _cfg(param_dtype=jax.numpy.bfloat16), id="bf16", marks=pytest.mark.full
        ),
        pytest.param(
            _cfg(scan_layers=False), _cfg(scan_layers=True), id="stacked", marks=pytest.mark.full
        ),
    ],
)
def test_assign_params_loads_what_load_published_loads(learner_cfg, sampler_cfg, tmp_path):
    """`assign_params` against `publish_weights` + `load_published`, with no train step,
    bitwise: a LoRA learner's adapters alone (the base stays the sampler's own), a bf16
    sampler (the same cast), the stacked layout from a per-layer learner; a copy (the
    learner's arrays may be deleted, as a donating train step does)."""
    learner = _perturbed(Decoder(learner_cfg, rngs=nnx.Rngs(0)), 0.05)
    publish_weights(learner, str(tmp_path), 1)
    own = Decoder(sampler_cfg, rngs=nnx.Rngs(0))
    from_disk, in_memory = nnx.clone(own), nnx.clone(own)
    assert load_published(from_disk, str(tmp_path), 1) == 1
    params = published_params(learner)
    assign_params(in_memory, params)
    for x in jax.tree.leaves(params):
        x.delete()  # the sampler holds its own copy
    for a, b in zip(_leaves(in_memory), _leaves(from_disk), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    moved = [
        float(np.abs(a - b).max()) for a, b in zip(_leaves(in_memory), _leaves(own), strict=True)
    ]
    assert max(moved) > 0
    if sampler_cfg.lora is not None:  # adapters only: the base is the sampler's own
        paths = [
            jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_leaves_with_path(nnx.state(own, nnx.Param))
        ]
        assert [m for p, m in zip(paths, moved, strict=True) if "_lora" not in p] == [0.0] * sum(
            "_lora" not in p for p in paths
        )


def test_assign_params_names_a_mismatch():
    model = Decoder(_cfg(), rngs=nnx.Rngs(0))
    other = published_params(Decoder(_cfg(VOCAB * 2), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"param .*embed.* has shape"):
        assign_params(model, other, "JaxSampler.set_params")


def test_the_hand_off_setting_is_checked():
    from ac2_jax.sampling.registry import SamplerConfig

    assert SamplerConfig().hand_off == "memory" and SamplerConfig(hand_off="disk").kind == "jax"
    with pytest.raises(ValueError, match=r"sampler.hand_off must be one of \('memory', 'disk'\)"):
        SamplerConfig(hand_off="ram")
    with pytest.raises(ValueError, match=r"sampler.hand_off='disk' has no effect with sampler"):
        SamplerConfig(kind="sglang", url="http://127.0.0.1:9", hand_off="disk")


# Review of issue 66: the background publish against the checkpoint saves and its readers.


def _tied(steps):
    """2 tasks x 2 attempts a step, for rl_steps 0..steps-1, every reward equal: no group
    carries a signal, so each update is skipped (no train step compiles) and the
    version stays 0 (published once, at the first step)."""
    out = []
    for s in range(steps):
        for i in range(4):
            t = Trace(
                task_id=f"t{i % 2}",
                attempt_id=str(i // 2),
                group_id=f"g{s}:t{i % 2}",
                reward=1.0,
                status="finished",
                metadata={"rl_step": s},
            )
            TraceRecorder(t).record(
                "main", Completion(PROMPTS[i % 2], [10, 11, 12], [-1.0] * 3, policy_version=0)
            )
            out.append(t)
    return out


def _skipping_trainer(tmp_path, steps, handed):
    config = RLConfig(
        steps=steps,
        tasks_per_step=2,
        attempts_per_task=2,
        batch=BatchConfig(seq_len=32, rows=4),
        optimizer=OptimizerConfig(learning_rate=1e-2),
    )
    return RLTrainer(
        Decoder(_cfg(), rngs=nnx.Rngs(0)),
        ReplayCollector(_tied(steps)),
        config,
        str(tmp_path / "run"),
        publish_dir=str(tmp_path / "published"),
        hand_off=lambda params, version: handed.append(version),
    )


def test_a_step_without_a_publish_saves_its_checkpoint_after_the_background_write(
    tmp_path, monkeypatch
):
    """Two Orbax saves must not overlap in one process (d101f46: the step-directory
    signals time out, or the publish never finalizes and its reader finds "nothing
    published (no finalized step)"). The background write was joined only by the next
    publish: a step without one (a skipped update: the version did not change) began
    its checkpoint save while the previous step's write still ran. The write is held
    here (a slow disk) until a save starts or 1 s passed, and the second step's save
    until the write began (at most 5 s); a save that starts while the write runs is
    recorded, and waits for it (so the real Orbax saves never overlap here)."""
    import threading
    import time

    from ac2_jax.models.io import params_io
    from ac2_jax.training.core.checkpoints import Checkpointer

    real_publish, real_save = params_io.publish_params, Checkpointer.save
    started, writing, saving = threading.Event(), threading.Event(), threading.Event()
    overlaps: list[int] = []

    def slow_publish(*args, **kwargs):
        started.set()
        writing.set()
        try:
            saving.wait(1.0)
            return real_publish(*args, **kwargs)
        finally:
            writing.clear()

    def save(self, step, *args, **kwargs):
        if step >= 2:  # the second step's save: once the first step's write has begun
            started.wait(5.0)
        if writing.is_set():
            overlaps.append(step)
            saving.set()
            while writing.is_set():
                time.sleep(0.01)
        return real_save(self, step, *args, **kwargs)

    monkeypatch.setattr(params_io, "publish_params", slow_publish)
    monkeypatch.setattr(Checkpointer, "save", save)
    handed: list[int] = []
    trainer = _skipping_trainer(tmp_path, 2, handed)
    try:
        history = asyncio.run(trainer.run())
    finally:
        trainer.close()
    assert [m["skipped_update"] for m in history] == [1.0, 1.0] and handed == [0]
    assert overlaps == [], f"checkpoint saves {overlaps} began during the background publish"
    assert latest_published(str(tmp_path / "published")) == 0


def test_an_error_of_the_background_write_is_raised_by_run(tmp_path, monkeypatch):
    """The folder's write fails in its thread: `run` raises that error (never lost),
    and `close` after it neither hangs nor raises it twice."""
    from ac2_jax.models.io import params_io

    def full_disk(*args, **kwargs):
        raise OSError("publish: no space left on device")

    monkeypatch.setattr(params_io, "publish_params", full_disk)
    handed: list[int] = []
    trainer = _skipping_trainer(tmp_path, 1, handed)
    try:
        with pytest.raises(OSError, match="no space left on device"):
            asyncio.run(trainer.run())
        assert handed == [0]  # the sampler had the weights; the folder write failed
    finally:
        trainer.close()
    assert trainer._writer is None  # the thread was shut down


def test_a_split_learner_refuses_the_in_memory_hand_off(tmp_path):
    """`run_learner` (training.rl.split): the endpoint is another process that reloads
    each step from the folder when on_progress tells it, before that step's background
    write finished (a 404 that stops the learner): refused before anything runs."""
    from ac2_jax.training.rl.split import run_learner

    trainer = _skipping_trainer(tmp_path, 1, [])
    trainer.on_progress = lambda steps_done, version: None
    try:
        with pytest.raises(ValueError, match=r"run_learner: the RLTrainer has hand_off"):
            asyncio.run(run_learner(trainer, lifecycle=None))
    finally:
        trainer.close()


def test_a_cancelled_run_leaves_the_write_error_to_close(tmp_path, monkeypatch):
    """`run` cancelled (Ctrl-C: asyncio cancels the task) while it waits for the
    background write: the write still runs, and its error is raised by `close`
    (it was dropped with the cancelled wait)."""
    import threading

    from ac2_jax.models.io import params_io

    started, release = threading.Event(), threading.Event()

    def failing(*args, **kwargs):
        started.set()
        release.wait(10.0)
        raise OSError("publish: no space left on device")

    monkeypatch.setattr(params_io, "publish_params", failing)
    trainer = _skipping_trainer(tmp_path, 1, [])

    async def cancel_while_writing():
        task = asyncio.ensure_future(trainer.run())
        await asyncio.to_thread(started.wait, 30.0)  # run() waits at its end's join now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()

    try:
        asyncio.run(cancel_while_writing())
        with pytest.raises(OSError, match="no space left on device"):
            trainer.close()
    finally:
        release.set()
        trainer.close()


@pytest.mark.full  # ~10 s of CPU: the train step's compile, 5 updates, 3 checkpoints
def test_checkpoint_every_k_steps_writes_the_folder_on_them_and_resumes_exactly(traces, tmp_path):
    """RLConfig.checkpoint_every (issue 66: each checkpoint and folder write ran beside the
    next step's rollout and update): 3 steps with checkpoint_every=2 checkpoint after
    steps 2 and 3 (the last), the sampler gets every update in memory (versions 1, 2, 3)
    and the folder only the checkpointed ones (2, 3). A run killed after step 3 but before
    its checkpoint resumes at step 2 and ends with the same weights, bitwise (fp32)."""
    import os
    import shutil

    from ac2_jax.models.io.params_io import published_steps
    from ac2_jax.trace import Trace as T

    with pytest.raises(ValueError, match=r"RLConfig.checkpoint_every must be >= 1, got 0"):
        RLConfig(checkpoint_every=0)
    replayed = []
    for s in range(3):  # the same 8 attempts each step (tagged rl_step s, own groups)
        for t in traces:
            c = T.from_dict(t.to_dict())
            c.metadata["rl_step"], c.group_id = s, f"g{s}:{t.task_id}"
            replayed.append(c)
    config = RLConfig(
        steps=3,
        tasks_per_step=2,
        attempts_per_task=4,
        checkpoint_every=2,
        # Every step trains on version 0's attempts: lags of 0, 1, 2 are kept.
        batch=BatchConfig(seq_len=32, rows=4, max_staleness=2),
        loss=PolicyGradientLoss(),
        optimizer=OptimizerConfig(learning_rate=1e-2),
    )
    steps = StepCache()

    def trainer(name, handed):
        return RLTrainer(
            Decoder(_cfg(), rngs=nnx.Rngs(0)),
            ReplayCollector(replayed),
            config,
            str(tmp_path / name),
            make_step=steps,
            publish_dir=str(tmp_path / name / "published"),
            hand_off=lambda params, version: handed.append(version),
        )

    handed: list[int] = []
    whole = trainer("whole", handed)
    try:
        history = asyncio.run(whole.run())
        final = _leaves(whole.model())
    finally:
        whole.close()
    assert [m["skipped_update"] for m in history] == [0.0, 0.0, 0.0] and handed == [1, 2, 3]
    ckpts = tmp_path / "whole" / "checkpoints"
    assert sorted(int(d) for d in os.listdir(ckpts) if d.isdigit()) == [2, 3]
    assert published_steps(str(tmp_path / "whole" / "published")) == [2, 3]
    # Killed after step 3, before its checkpoint: the checkpoint of step 2 is the last.
    shutil.copytree(ckpts, tmp_path / "killed" / "checkpoints")
    shutil.rmtree(tmp_path / "killed" / "checkpoints" / "3")
    again: list[int] = []
    resumed = trainer("killed", again)
    try:
        assert resumed.start_step == 2
        (m,) = asyncio.run(resumed.run())
        assert m["rl_step"] == 2 and m["skipped_update"] == 0.0
        for a, b in zip(_leaves(resumed.model()), final, strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
        resumed.close()
    assert again == [2, 3]  # the restored weights, then the redone update
    assert published_steps(str(tmp_path / "killed" / "published")) == [2, 3]
