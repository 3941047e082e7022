"""Meshes, param / optimizer-state shardings from the model's names, pmap helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ac2_jax.models.axes import AxisRules
from ac2_jax.segments import pack_segments
from ac2_jax.training.core.sharding import (
    batch_sharding,
    make_mesh,
    merge_rows,
    param_shardings,
    replicate,
    shard_batch,
    shard_state,
    split_rows,
    state_shardings,
    unreplicate,
)
from ac2_jax.training.core.state import OptimizerConfig, create_train_state
from ac2_jax.training.rl import rl_segment


class Named(nnx.Module):
    """Params annotated with logical axis names, as ac2_jax.models.Decoder does."""

    def __init__(self, vocab=48):
        self.embed = nnx.Param(jnp.arange(vocab * 8, dtype=jnp.float32).reshape(vocab, 8),
                               out_sharding=("vocab", "embed"), eager_sharding=False)
        self.up = nnx.Param(jnp.ones((8, 12)), out_sharding=("embed", "mlp"),
                            eager_sharding=False)
        self.norm = nnx.Param(jnp.ones((8,)))


def test_make_mesh_axes_and_errors():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    assert mesh.axis_names == ("data", "fsdp", "tensor") and mesh.devices.shape == (2, 2, 2)
    assert make_mesh().devices.size == 1
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(data=16)
    with pytest.raises(ValueError, match=">= 1"):
        make_mesh(data=0)


def test_state_shardings_follow_the_model_names():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    _, state = create_train_state(Named(vocab=45), OptimizerConfig(weight_decay=0.1))
    # 45 vocabulary rows do not split over tensor (2): an error naming the param ...
    with pytest.raises(ValueError, match=r"sharding embed: dimension 0 \('vocab', size 45\) "
                                         r"does not split over mesh axes \('tensor',\)"):
        state_shardings(state, mesh)
    # ... or, asked for, a replicated dimension that is counted.
    fallbacks = []
    sh = state_shardings(state, mesh, AxisRules(indivisible="replicate"), fallbacks)
    assert [(f.where, f.dim, f.size, f.ways) for f in fallbacks] == [("embed", 0, 45, 2)]
    spec = lambda var: var.get_value().spec  # noqa: E731  (a Param holding a sharding)
    assert spec(sh.params["embed"]) == P(None, "fsdp")
    assert spec(sh.params["up"]) == P("fsdp", "tensor")
    assert spec(sh.params["norm"]) == P(None)
    adam = sh.opt_state[1][0]
    assert spec(adam.mu["up"]) == spec(adam.nu["up"]) == P("fsdp", "tensor")
    assert adam.count.spec == P() and sh.step.spec == P() and sh.rng.spec == P()
    _, state = create_train_state(Named(vocab=46), OptimizerConfig(weight_decay=0.1))
    placed = shard_state(state, mesh)
    up = placed.params["up"][...]
    assert up.sharding.spec == P("fsdp", "tensor")
    assert up.addressable_shards[0].data.shape == (4, 6)
    np.testing.assert_array_equal(np.asarray(placed.params["embed"][...]),
                                  np.asarray(state.params["embed"][...]))
    assert spec(param_shardings(state.params, mesh)["up"]) == P("fsdp", "tensor")


def test_batch_rows_split_over_data_and_fsdp():
    segs = [rl_segment(np.arange(5), np.ones(5), np.zeros(5), task=f"t{i}") for i in range(8)]
    batch = pack_segments(segs, 10, rows_multiple=8)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    placed = shard_batch(batch, mesh)
    assert placed.tokens.sharding == batch_sharding(mesh)
    assert placed.tokens.addressable_shards[0].data.shape == (batch.shape[0] // 4, 10)
    with pytest.raises(ValueError, match="rows_multiple=8"):
        shard_batch(jax.tree.map(lambda x: x[:6], batch), make_mesh(data=8))


def test_replicate_split_and_merge_round_trip():
    tree = {"a": np.arange(6.0), "b": np.ones((2, 3), np.int32)}
    rep = replicate(tree, jax.devices()[:4])
    assert rep["a"].shape == (4, 6) and len(rep["a"].sharding.device_set) == 4
    np.testing.assert_array_equal(unreplicate(rep)["a"], tree["a"])
    rows = {"x": np.arange(24).reshape(8, 3)}
    split = split_rows(rows, 4)
    assert split["x"].shape == (4, 2, 3)
    np.testing.assert_array_equal(merge_rows(split)["x"], rows["x"])
    with pytest.raises(ValueError, match="do not split over 3 devices"):
        split_rows(rows, 3)


def test_split_rows_refuses_a_batch_with_grammar_masks():
    """The mask table is not rows: split over devices, each would read the wrong masks."""
    import dataclasses

    from ac2_jax.segments import Segment

    seg = Segment(tokens=[1, 2, 3, 4], loss_mask=[0, 1, 1, 1], task="t")
    batch = pack_segments([seg] * 4, seq_len=8)
    assert split_rows(batch, 2).tokens.shape[0] == 2
    masked = dataclasses.replace(batch, constraint_masks=np.ones((4, 1), np.uint32))
    with pytest.raises(ValueError, match="constraint_masks"):
        split_rows(masked, 2)


def test_a_lora_models_frozen_base_is_sharded_by_its_names():
    """The frozen base of a LoRA model (TrainState.rest) follows the logical axes like
    the params: on an fsdp mesh each device holds its share of every base weight, not
    a replicated copy (a Qwen3-8B base replicated on each v5e chip was 30.5 GiB of
    16: docs/notes/2026-12-07-pod-ready-aot-on-cpu-host.md)."""
    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.models.lora import LoRAConfig

    config = DecoderConfig.tiny(vocab_size=64).replace(lora=LoRAConfig(rank=4))
    _, state = create_train_state(Decoder(config, rngs=nnx.Rngs(0)), OptimizerConfig())
    sh = state_shardings(state, make_mesh(fsdp=2))
    rest = {k: v.get_value().spec for k, v in nnx.to_flat_state(sh.rest)}
    assert rest[("layers", 0, "self_attn", "q_proj")] == P("fsdp", "tensor")  # (embed, heads)
    assert rest[("layers", 1, "mlp", "down_proj")] == P("tensor", "fsdp")  # (mlp, embed)
    assert rest[("embed_tokens",)] == P("tensor", "fsdp")  # (vocab, embed)
