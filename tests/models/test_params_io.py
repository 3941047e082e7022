"""Orbax params I/O and the publish protocol (an Orbax CheckpointManager directory),
on real files in tmp dirs."""

import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from ac2_jax.models import (
    Decoder,
    DecoderConfig,
    latest_published,
    load_published,
    publish_weights,
    restore_params,
    save_params,
    with_layout,
)
from ac2_jax.models.io.params_io import PARAMS, published_steps

CONFIG = DecoderConfig.tiny(32, num_layers=1, tie_embeddings=False)


def params(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def assert_same(a, b):
    pa, pb = params(a), params(b)
    assert len(pa) == len(pb)
    for x, y in zip(pa, pb):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def models():
    return [Decoder(CONFIG, rngs=nnx.Rngs(seed)) for seed in range(3)]


def test_save_restore_round_trip_exact(models, tmp_path):
    a, b, _ = models
    assert any(np.any(x != y) for x, y in zip(params(a), params(b)))
    target = Decoder(CONFIG, rngs=nnx.Rngs(0))
    nnx.update(target, nnx.state(b, nnx.Param))
    save_params(a, str(tmp_path / "ckpt"))
    restore_params(target, str(tmp_path / "ckpt"))
    assert_same(target, a)
    with pytest.raises(FileExistsError, match="overwrite"):
        save_params(b, str(tmp_path / "ckpt"))
    save_params(b, str(tmp_path / "ckpt"), overwrite=True)
    restore_params(target, str(tmp_path / "ckpt"))
    assert_same(target, b)


def test_restore_errors(models, tmp_path):
    with pytest.raises(FileNotFoundError):
        restore_params(models[0], str(tmp_path / "missing"))
    save_params(models[0], str(tmp_path / "ckpt"))
    other = Decoder(CONFIG.replace(hidden_size=16), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="shape"):
        restore_params(other, str(tmp_path / "ckpt"))
    tied = Decoder(CONFIG.replace(tie_embeddings=True), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="lm_head.*missing from the model"):
        restore_params(tied, str(tmp_path / "ckpt"))


def test_checkpoints_load_across_layer_layouts(tmp_path):
    """A scanned (stacked) model's params restore into a per-layer model and back."""
    CONFIG2 = CONFIG.replace(num_layers=2)
    per_layer = Decoder(CONFIG2, rngs=nnx.Rngs(0))
    scanned = with_layout(Decoder(CONFIG2, rngs=nnx.Rngs(1)), True)
    save_params(scanned, str(tmp_path / "stacked"))
    target = Decoder(CONFIG2, rngs=nnx.Rngs(2))
    restore_params(target, str(tmp_path / "stacked"))
    assert_same(with_layout(target, True), scanned)
    publish_weights(per_layer, str(tmp_path / "pub"), step=1)
    into = with_layout(Decoder(CONFIG2, rngs=nnx.Rngs(3)), True)
    assert load_published(into, str(tmp_path / "pub")) == 1
    assert_same(into, with_layout(per_layer, True))
    other = Decoder(CONFIG2.replace(hidden_size=16), rngs=nnx.Rngs(0))  # per-layer, other shape
    with pytest.raises(ValueError, match="shape"):
        restore_params(other, str(tmp_path / "stacked"))


def test_publish_latest_and_prune(models, tmp_path):
    pub = str(tmp_path / "pub")
    target = Decoder(CONFIG, rngs=nnx.Rngs(9))
    assert latest_published(pub) is None
    with pytest.raises(FileNotFoundError, match="nothing published"):
        load_published(target, pub)

    publish_weights(models[0], pub, step=10, keep=2)
    assert latest_published(pub) == 10
    publish_weights(models[1], pub, step=20, keep=2)
    assert latest_published(pub) == 20
    assert not os.path.exists(os.path.join(pub, "LATEST"))  # Orbax lists the steps
    with ocp.CheckpointManager(pub, item_names=(PARAMS,)) as mgr:  # a plain Orbax directory
        assert mgr.latest_step() == 20 and list(mgr.all_steps()) == [10, 20]
    assert load_published(target, pub) == 20
    assert_same(target, models[1])
    assert load_published(target, pub, step=10) == 10
    assert_same(target, models[0])

    publish_weights(models[2], pub, step=30, keep=2)  # keep=2 prunes step 10
    assert sorted(n for n in os.listdir(pub) if n.isdigit()) == ["20", "30"]
    assert published_steps(pub) == [20, 30]
    assert not [n for n in os.listdir(pub) if "tmp" in n]
    assert load_published(target, pub) == 30
    assert_same(target, models[2])
    with pytest.raises(FileNotFoundError, match="step 10"):
        load_published(target, pub, step=10)
    with pytest.raises(ValueError, match="step"):
        publish_weights(models[0], pub, step=-1)


def test_republish_replaces_and_a_rollback_drops_newer_steps(models, tmp_path):
    pub = str(tmp_path / "pub")
    target = Decoder(CONFIG, rngs=nnx.Rngs(9))
    publish_weights(models[0], pub, step=5)
    publish_weights(models[1], pub, step=5)  # the latest step again: replaced
    assert published_steps(pub) == [5]
    assert load_published(target, pub) == 5
    assert_same(target, models[1])
    publish_weights(models[0], pub, step=7)
    publish_weights(models[2], pub, step=6)  # a run resumed from step 6 rolls back
    assert published_steps(pub) == [5, 6] and latest_published(pub) == 6
    assert load_published(target, pub) == 6
    assert_same(target, models[2])
    other = Decoder(CONFIG.replace(hidden_size=16), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="shape.*step 6 of"):
        load_published(other, pub)


def test_interrupted_publish_is_never_seen(models, tmp_path, monkeypatch):
    """A save that dies before Orbax's finalizing rename leaves a tmp directory
    holding every file; readers ignore it and the next publish goes on."""
    from orbax.checkpoint._src.path import async_path

    pub = str(tmp_path / "pub")
    target = Decoder(CONFIG, rngs=nnx.Rngs(9))
    publish_weights(models[0], pub, step=1)

    async def crash(*_a, **_k):
        raise RuntimeError("killed before the rename")

    with monkeypatch.context() as m:
        m.setattr(async_path, "rename", crash)
        with pytest.raises(RuntimeError, match="killed before the rename"):
            publish_weights(models[1], pub, step=2)
    left = [n for n in os.listdir(pub) if n.startswith("2.") and "tmp" in n]
    assert left, os.listdir(pub)  # the half-finished step 2 is on disk ...
    assert os.listdir(os.path.join(pub, left[0]))
    assert latest_published(pub) == 1 and published_steps(pub) == [1]  # ... and not listed
    assert load_published(target, pub) == 1
    assert_same(target, models[0])
    with pytest.raises(FileNotFoundError, match="step 2 is not in"):
        load_published(target, pub, step=2)
    publish_weights(models[2], pub, step=3)
    assert load_published(target, pub) == 3
    assert_same(target, models[2])


def test_a_lora_model_publishes_its_adapters_alone(tmp_path):
    """publish_weights of a LoRA model writes the adapters and their config, not the
    base: a sampler model with the same base loads them (load_published), and
    read_published_adapter gives them to a bank; a full-model step is refused."""
    from ac2_jax.models.io.params_io import read_published_adapter
    from ac2_jax.models.lora import LoRAConfig, adapter_params

    lora = LoRAConfig(rank=2, alpha=3.0, targets=("q", "down"), rslora=True)
    learner = Decoder(CONFIG.replace(lora=lora, scan_layers=True), rngs=nnx.Rngs(0))
    state = nnx.state(learner, nnx.LoRAParam)
    nnx.update(learner, jax.tree.map(lambda x: x + 0.5, state))
    publish_weights(learner, str(tmp_path / "pub"), 7)
    step_dir = tmp_path / "pub" / "7"
    size = sum(f.stat().st_size for f in step_dir.rglob("*") if f.is_file())
    publish_weights(Decoder(CONFIG, rngs=nnx.Rngs(0)), str(tmp_path / "full"), 7)
    full = sum(f.stat().st_size for f in (tmp_path / "full" / "7").rglob("*") if f.is_file())
    assert size < full / 2  # the base did not travel
    sampler = Decoder(CONFIG.replace(lora=lora), rngs=nnx.Rngs(0))  # per-layer layout
    assert load_published(sampler, str(tmp_path / "pub")) == 7
    got = adapter_params(sampler)
    want = adapter_params(with_layout(learner, False))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(x, y)
    params, cfg, step = read_published_adapter(str(tmp_path / "pub"))
    assert (cfg, step) == (lora, 7)
    assert jax.tree.structure(params) == jax.tree.structure(adapter_params(learner))
    with pytest.raises(ValueError, match="full model"):
        read_published_adapter(str(tmp_path / "full"))


def test_loads_read_a_group_of_params_at_a_time(models, tmp_path, monkeypatch):
    """`load_published` and `restore_params` read about GROUP_BYTES of params per Orbax
    call (the rest skipped as placeholders), so a load holds one group of read buffers
    beside the model, not a second copy of everything; the params land exactly, in
    either layout, and nothing reaches the model before every group is read."""
    from ac2_jax.models.io import params_io

    a, b, _ = models
    publish_weights(a, str(tmp_path / "pub"), 1)
    save_params(a, str(tmp_path / "ckpt"))
    calls = []
    real = params_io._partial_restore
    monkeypatch.setattr(params_io, "_partial_restore",
                        lambda target: calls.append(target) or real(target))
    monkeypatch.setattr(params_io, "GROUP_BYTES", 4096)
    n_leaves = len(params(a))
    for load in (lambda m: load_published(m, str(tmp_path / "pub")),
                 lambda m: restore_params(m, str(tmp_path / "ckpt"))):
        for scan in (False, True):
            calls.clear()
            target = with_layout(Decoder(CONFIG, rngs=nnx.Rngs(1)), scan)
            load(target)
            assert_same(with_layout(a, scan), target)
            assert 1 < len(calls) <= n_leaves
            for call in calls:  # each call reads a strict part of the tree
                read = [x for x in jax.tree.leaves(call, is_leaf=lambda x: x is ocp.PLACEHOLDER)
                        if x is not ocp.PLACEHOLDER]
                assert 0 < len(read) < n_leaves
    # A read that fails part way leaves the model as it was.
    target = Decoder(CONFIG, rngs=nnx.Rngs(2))
    before = params(target)

    def flaky(target):
        calls.append(target)
        if len(calls) > 2:
            raise OSError("the disk went away")
        return real(target)

    monkeypatch.setattr(params_io, "_partial_restore", flaky)
    calls.clear()
    with pytest.raises(OSError, match="disk went away"):
        load_published(target, str(tmp_path / "pub"))
    assert len(calls) == 3
    for x, y in zip(before, params(target), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_step_written_by_orbax_standard_save_still_loads(models, tmp_path):
    """Publish steps written before the loads read by groups (Orbax StandardSave) load."""
    a, _, _ = models
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False)
    with ocp.CheckpointManager(str(tmp_path), options=options,
                               item_handlers={PARAMS: ocp.StandardCheckpointHandler()}) as mgr:
        mgr.save(3, args=ocp.args.Composite(
            **{PARAMS: ocp.args.StandardSave(nnx.to_pure_dict(nnx.state(a, nnx.Param)))}))
        mgr.wait_until_finished()
    target = Decoder(CONFIG, rngs=nnx.Rngs(1))
    assert load_published(target, str(tmp_path)) == 3
    assert_same(a, target)
