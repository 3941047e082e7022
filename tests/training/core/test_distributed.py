"""A multi-host learner on JAX's own runtime: 2 processes x 4 CPU devices
(`jax.distributed` over 127.0.0.1, gloo collectives), each packing only its
share of the segments, train exactly as 1 process x 8 devices; the 2-process
checkpoint restores in 1 process and continues identically (fp32, 1e-5).
The 2-process learner also publishes its weights (every process calls the
Orbax save): one published step results, which a sampler in this process
loads and serves with the 1-process learner's logits and samples (1e-5).
The same launches then run an RLTrainer (ReplayCollector of fixed traces with
main and compactor episodes, non-zero advantages) for 2 steps: each process
packs its share of the segments, and the 2-process learner ends with the
1-process learner's losses and parameters (1e-5); both processes log the
same metrics. The worker is tests/support/multihost_worker.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ac2_jax.segments import pack_segments, task_names
from ac2_jax.training.core import distributed
from ac2_jax.training.rl import rl_segment
from tests.support.child_env import child_env
from tests.support.ports import reserved_port

TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(TESTS, "support", "multihost_worker.py")


def _run(out, workdir, steps, *, processes=1, restore=False, snapshot_at=0, publish_dir=None,
         rl_workdir=None, then_restore=None):
    out.mkdir(exist_ok=True)
    port = reserved_port()
    env = child_env()  # the suite's compile flags, not its 8 forced devices
    procs = []
    for i in range(processes):
        cmd = [sys.executable, WORKER, "--out", str(out), "--workdir", str(workdir),
               "--steps", str(steps), "--local_devices", str(8 // processes)]
        if processes > 1:
            cmd += ["--process_id", str(i), "--num_processes", str(processes), "--port", str(port)]
        if restore:
            cmd.append("--restore")
        if snapshot_at:
            cmd += ["--snapshot_at", str(snapshot_at)]
        if publish_dir is not None:
            cmd += ["--publish_dir", str(publish_dir), "--publish_at", str(snapshot_at or steps)]
        if rl_workdir is not None:
            cmd += ["--rl_workdir", str(rl_workdir), "--rl_steps", "2"]
        if then_restore is not None:
            cmd += ["--then_restore", str(then_restore), "--then_steps", "2"]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=240)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return np.load(out / "result.npz")


def _params(r, prefix="p"):
    n = len([k for k in r.files if k[:1] == prefix and k[1:].isdigit()])
    return [r[f"{prefix}{i}"] for i in range(n)]


def test_two_processes_train_and_checkpoint_like_one(tmp_path):
    two = _run(tmp_path / "two", tmp_path / "w2", 3, processes=2, publish_dir=tmp_path / "pub2",
               rl_workdir=tmp_path / "rl2")
    # 1 process x 8 devices; then, in the same process, a new Trainer over fresh weights
    # restores the 2-process checkpoint (w2, step 3) and trains 2 more steps (one process
    # start fewer than a separate resuming run).
    five = _run(tmp_path / "five", tmp_path / "w5", 5, snapshot_at=3,
                publish_dir=tmp_path / "pub1", rl_workdir=tmp_path / "rl1",
                then_restore=tmp_path / "w2")
    _rl_learners_agree(tmp_path, two, five)
    np.testing.assert_allclose(two["losses"], five["losses"][:3], rtol=1e-5)
    assert five["losses"][2] < five["losses"][0]  # it trained
    for a, b in zip(_params(two), _params(five, "s")):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    _published_weights_serve_alike(tmp_path / "pub2", tmp_path / "pub1", step=3)
    # The 2-process checkpoint (step 3) restores in 1 process x 8 devices and goes on
    # exactly as the 1-process run did for steps 4 and 5.
    assert int(five["then_start"]) == 3
    np.testing.assert_allclose(five["then_losses"], five["losses"][3:], rtol=1e-5)
    resumed = _params(five, "q")
    assert len(resumed) == len(_params(five)) > 0
    for a, b in zip(resumed, _params(five)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _untimed(metrics):
    return {k: v for k, v in metrics.items() if "time" not in k}


def _rl_learners_agree(tmp_path, two, five):
    """The RLTrainer on 2 processes x 4 devices (each packing its share of the
    segments) = on 1 process x 8 devices; both processes log the same metrics."""
    np.testing.assert_allclose(two["rl_losses"], five["rl_losses"], rtol=1e-5)
    for a, b in zip(_params(two, "r"), _params(five, "r")):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    histories = [json.loads((tmp_path / d / f"rl_metrics{i}.json").read_text())
                 for d, i in (("two", 0), ("two", 1), ("five", 0))]
    assert len(histories[0]) == 2
    for m0, m1, m in zip(*histories):
        assert m0["skipped_update"] == 0.0 and m0["adv_abs_mean"] > 0 and m0["grad_norm"] > 0
        assert m0["trained_tokens/compactor"] > 0 and m0["trained_tokens/main"] > 0
        assert _untimed(m0) == _untimed(m1)  # every process logs the same step
        computed = {k for k in m if k in ("loss", "grad_norm", "kl_to_sampler", "entropy")}
        # The drift alarm runs on a single-process learner only (training/rl/alarms.py; the
        # replayed traces' made-up log-probs fire it there): its keys are the one's alone.
        single = {k for k in m if k.startswith("drift/") or k == "alarms/fired/drift"}
        assert not single & set(m0), "a multi-process learner now checks drift: compare it"
        assert {k: v for k, v in _untimed(m0).items() if k not in computed} == {
            k: v for k, v in _untimed(m).items() if k not in computed | single}  # host-side: exact
        for k in computed:
            np.testing.assert_allclose(m0[k], m[k], rtol=1e-5, atol=1e-6, err_msg=k)
    logs = [[_untimed(json.loads(line)) for line in (tmp_path / "rl2" / p).read_text().splitlines()]
            for p in ("metrics/metrics.jsonl", "metrics/process1/metrics.jsonl")]
    assert len(logs[0]) == 2 and logs[0] == logs[1]


def _published_weights_serve_alike(multi, single, step):
    """The step the 2-process learner published is one complete Orbax step, and a
    sampler loading it serves what the 1-process learner's step serves."""
    import asyncio

    import jax.numpy as jnp
    from flax import nnx

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.models.io.params_io import load_published, published_steps
    from ac2_jax.sampling import SamplingParams
    from ac2_jax.sampling.engine.jax_sampler import JaxSampler

    assert published_steps(str(multi)) == [step] == published_steps(str(single))
    cfg = DecoderConfig.tiny(vocab_size=64, num_layers=2)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 12)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(12, dtype=jnp.int32), (2, 12))
    logits = []
    for d in (multi, single):
        model = Decoder(cfg, rngs=nnx.Rngs(7))  # other weights until the load
        assert load_published(model, str(d), step) == step
        logits.append(np.asarray(model(tokens, positions, jnp.ones_like(tokens))))
    np.testing.assert_allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    assert np.abs(logits[0]).max() > 0

    async def sample(d):
        sampler = JaxSampler(Decoder(cfg, rngs=nnx.Rngs(7)), publish_dir=str(d), max_context=64,
                             max_batch=1, seed=0)
        try:
            assert sampler.load_weights(step) == step == sampler.policy_version
            return await sampler.generate(list(range(1, 9)), SamplingParams(
                temperature=1.0, max_tokens=8, seed=3))
        finally:
            sampler.close()

    a, b = (asyncio.run(sample(d)) for d in (multi, single))
    assert a.output_ids == b.output_ids and a.policy_version == b.policy_version == step
    np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-5)


def test_process_share_and_offsets_cover_the_batch_once():
    items = list(range(11))
    shares = [distributed.process_share(items, i, 3) for i in range(3)]
    assert sorted(sum(shares, [])) == items
    with pytest.raises(ValueError, match="process_index 3"):
        distributed.process_share(items, 3, 3)


def test_a_share_keeps_global_task_ids_and_segment_numbers():
    segs = [rl_segment(np.arange(4), [0, 1, 1, 1], np.zeros(4), task=t) for t in "abcab"]
    share = distributed.process_share(segs, 1, 2)  # segments 1, 3: tasks b, a
    b = pack_segments(share, 8, all_tasks=task_names(segs), segment_offset=3, min_segments=8)
    assert sorted(set(np.asarray(b.task_ids)[b.segment_ids > 0].tolist())) == [0, 1]
    assert sorted(set(np.asarray(b.segment_index)[b.segment_ids > 0].tolist())) == [3, 4]
    with pytest.raises(ValueError, match="not in all_tasks"):
        pack_segments(segs, 8, all_tasks=["a"])
    with pytest.raises(ValueError, match="layout='flat'"):
        pack_segments(segs, 8, all_tasks=task_names(segs), layout="tree")


def test_global_batch_replicates_the_grammar_mask_table():
    """A share's constraint_masks (the same global table on every process) becomes one
    replicated array; the row leaves are sharded over the batch axes as before. (One
    process here: the two-process runs above train batches without masks.)"""
    from ac2_jax.segments import pack_mask_bits
    from ac2_jax.training.core.sharding import make_mesh
    masks = np.zeros((3, 40), bool)
    masks[[0, 1, 2], [1, 2, 3]] = True
    segs = [rl_segment(np.arange(4), [0, 1, 1, 1], np.zeros(4), task=t).with_constraints(
        np.array([0, 1, 2, 3], np.int32), pack_mask_bits(masks)) for t in "ab"]
    local = pack_segments(segs, 8, rows_multiple=8, min_masks=4)
    out = distributed.global_batch(local, make_mesh(data=8))
    assert out.constraint_masks.shape == (4, 2)
    assert out.constraint_masks.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(out.constraint_masks), local.constraint_masks)
    assert not out.tokens.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(out.tokens), local.tokens)
