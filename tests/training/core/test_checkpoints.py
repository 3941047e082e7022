"""Orbax checkpoints: resume in a fresh process equals the uninterrupted run; restore
onto another mesh or one device; keep-N; publish to the sampler."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.models.io.params_io import load_published
from ac2_jax.segments import pack_segments
from ac2_jax.training import (
    Checkpointer,
    OptimizerConfig,
    SFTLoss,
    create_train_state,
    make_mesh,
    make_train_step,
    publish,
)
from ac2_jax.training.core import abstract_train_state, state_shardings
from ac2_jax.training.rl import rl_segment

CFG = DecoderConfig.tiny(vocab_size=48, num_layers=1)
# Warmup makes the update depend on the step, so a resume must restore it.
OPT = OptimizerConfig(learning_rate=1e-2, warmup_steps=4, weight_decay=0.1)
SAVE_AT = 2


def make_batch(i: int):
    """The i-th batch of a fixed data stream (the data position is just i)."""
    rng = np.random.default_rng(1000 + i)
    segs = [rl_segment(rng.integers(0, 48, 12), (rng.random(12) > 0.3).astype(np.float32),
                    np.zeros(12), task=f"t{k % 3}") for k in range(8)]
    return pack_segments(segs, 12, rows_multiple=8)


def make_step(graphdef):
    return make_train_step(graphdef, SFTLoss(), OPT, mesh=make_mesh(data=4, fsdp=2))


def resume_main(ckpt_dir: str, out_path: str) -> None:
    """Runs in a fresh process: restore the latest checkpoint, take the next step."""
    graphdef, abstract = abstract_train_state(lambda: Decoder(CFG), OPT)
    step = make_step(graphdef)
    ck = Checkpointer(ckpt_dir)
    state, data, _ = ck.restore(abstract, shardings=state_shardings(abstract, step.mesh))
    state, metrics = step(state, make_batch(data["next_batch"]))
    state = jax.device_get(state)
    np.savez(out_path, loss=metrics["loss"], step=state.step, rng=state.rng,
             **{f"p{i}": x for i, x in enumerate(jax.tree.leaves(state.params))})
    ck.close()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Uninterrupted run on a (data=4, fsdp=2) mesh, async-saving after step SAVE_AT."""
    ckpt_dir = str(tmp_path_factory.mktemp("ckpt"))
    graphdef, state = create_train_state(Decoder(CFG, rngs=nnx.Rngs(0)), OPT)
    step = make_step(graphdef)
    state = step.place(state)
    ck = Checkpointer(ckpt_dir, max_to_keep=2)
    for i in range(SAVE_AT):
        state, _ = step(state, make_batch(i))
    ck.save(SAVE_AT, state, {"next_batch": SAVE_AT})
    saved = jax.device_get(state)  # the state the checkpoint must hold
    state, metrics = step(state, make_batch(SAVE_AT))  # donates `state` while saving
    ck.close()
    return dict(dir=ckpt_dir, graphdef=graphdef, saved=saved, next=jax.device_get(state),
                loss=float(metrics["loss"]))


@pytest.mark.full  # a resume in a child process
def test_resume_in_a_fresh_process_equals_the_uninterrupted_run(run, tmp_path):
    out = str(tmp_path / "resumed.npz")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path.insert(0, {tests_dir!r}); import test_checkpoints as t; "
            f"t.resume_main({run['dir']!r}, {out!r})")
    # The suite's XLA_FLAGS (tests/conftest.py): its 8 devices and its compile flags, so
    # the child's step is the parent's program, read from the run's compilation cache.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = np.load(out)
    assert int(got["step"]) == SAVE_AT + 1
    np.testing.assert_array_equal(got["rng"], run["next"].rng)
    np.testing.assert_allclose(float(got["loss"]), run["loss"], rtol=1e-6)
    for i, want in enumerate(jax.tree.leaves(run["next"].params)):
        np.testing.assert_allclose(got[f"p{i}"], want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("target", ["mesh_2x2x2", "one_device"])
def test_restore_onto_another_layout(run, target):
    graphdef, abstract = abstract_train_state(lambda: Decoder(CFG), OPT)
    shardings = (state_shardings(abstract, make_mesh(data=2, fsdp=2, tensor=2))
                 if target == "mesh_2x2x2" else None)
    with Checkpointer(run["dir"]) as ck:
        state, data, step = ck.restore(abstract, shardings=shardings)
    assert step == SAVE_AT and data == {"next_batch": SAVE_AT}
    embed = state.params["embed_tokens"][...]
    if target == "mesh_2x2x2":
        assert embed.sharding.spec == P("tensor", "fsdp") and len(embed.sharding.device_set) == 8
    else:
        assert len(embed.sharding.device_set) == 1
    for a, b in zip(jax.tree.leaves(run["saved"]), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(b), a)


def test_keep_newest_n_and_restore_a_given_step(run, tmp_path):
    with Checkpointer(tmp_path / "keep", max_to_keep=2) as ck:
        for s in range(4):
            ck.save(s, run["saved"], {"next_batch": s})
    with Checkpointer(tmp_path / "keep") as ck:
        assert ck.all_steps() == [2, 3] and ck.latest_step() == 3
        _, data, step = ck.restore(run["saved"], step=2)
    assert (data, step) == ({"next_batch": 2}, 2)


def test_restore_errors_are_named(run, tmp_path):
    with Checkpointer(tmp_path / "empty") as ck:
        with pytest.raises(FileNotFoundError, match="no checkpoint"):
            ck.restore(run["saved"])
    _, other = abstract_train_state(lambda: Decoder(CFG.replace(num_layers=2)), OPT)
    with Checkpointer(run["dir"]) as ck:
        with pytest.raises(ValueError, match="does not match the target"):
            ck.restore(other)
    with pytest.raises(ValueError, match="max_to_keep"):
        Checkpointer(tmp_path / "bad", max_to_keep=0)


def test_publish_reaches_the_sampler(run, tmp_path):
    path = publish(run["graphdef"], run["saved"], tmp_path / "publish")
    assert os.path.isdir(path)
    sampler_model = Decoder(CFG, rngs=nnx.Rngs(7))
    assert load_published(sampler_model, str(tmp_path / "publish")) == SAVE_AT
    for a, b in zip(jax.tree.leaves(run["saved"].params),
                    jax.tree.leaves(nnx.state(sampler_model, nnx.Param))):
        np.testing.assert_array_equal(np.asarray(b), a)
