"""models/lora.py: the adapter math, its config, and an adapter bank's slots.

Tolerance: fp32, 1e-5 on logits. PEFT parity lives in test_peft_io.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.models.io.peft_io import merge_lora, write_slot
from ac2_jax.models.lora import (
    LoRAConfig,
    adapter_params,
    has_lora,
    lora_delta,
    lora_update,
    trainable_filter,
)
from ac2_jax.models.stacking import with_layout

CONFIG = DecoderConfig.tiny(vocab_size=64, initializer_range=0.3)
T = jnp.asarray([[1, 5, 9, 2, 7, 3], [4, 4, 8, 1, 0, 6]])
POS = jnp.tile(jnp.arange(6), (2, 1))
SEG = jnp.ones_like(T)


BASE = Decoder(CONFIG, rngs=nnx.Rngs(0))


def with_base(m):
    """`m` with BASE's weights (adapters draw from the same rng stream, so a model
    built with them has other base weights)."""
    base = BASE if not m.config.scan_layers else with_layout(BASE, True)
    nnx.update(m, nnx.state(base, nnx.Param))
    return m


def adapted(lora: LoRAConfig, seed=1, scan=False):
    m = with_base(Decoder(CONFIG.replace(lora=lora, scan_layers=scan), rngs=nnx.Rngs(0)))
    leaves, tree = jax.tree.flatten(nnx.state(m, nnx.LoRAParam))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    nnx.update(m, jax.tree.unflatten(tree, [0.2 * jax.random.normal(k, x.shape)
                                            for k, x in zip(keys, leaves, strict=True)]))
    return m


def test_config_checks_and_scale():
    assert LoRAConfig(rank=8, alpha=16).scale == 2.0
    assert LoRAConfig(rank=16, alpha=8, rslora=True).scale == pytest.approx(2.0)
    assert LoRAConfig(targets=("q_proj", "v")).targets == ("q", "v")
    for bad, match in (({"rank": 0}, "rank"), ({"alpha": 0}, "alpha"), ({"targets": ()}, "empty"),
                       ({"slots": 1}, "slots"), ({"base_dtype": "int8"}, "base_dtype"),
                       ({"targets": "q"}, "sequence")):
        with pytest.raises((ValueError, TypeError), match=match):
            LoRAConfig(**bad)
    assert DecoderConfig.tiny(lora={"rank": 2}).lora == LoRAConfig(rank=2)


def test_delta_is_the_low_rank_product():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 5))
    a, b = jax.random.normal(jax.random.PRNGKey(1), (5, 2)), jax.random.normal(
        jax.random.PRNGKey(2), (2, 7))
    np.testing.assert_allclose(lora_delta(x, {"a": a, "b": b}, 0.5, None, jnp.float32),
                               0.5 * x @ (a @ b), atol=1e-5)
    # a bank: row b uses its own slot and scale
    A, B = jnp.stack([a * 0, a, 2 * a]), jnp.stack([b * 0, b, b])
    rows = (jnp.asarray([2, 1]), jnp.asarray([1.0, 0.5]))
    got = lora_delta(x, {"a": A, "b": B}, None, rows, jnp.float32)
    np.testing.assert_allclose(got[0], 2 * x[0] @ (a @ b), atol=1e-5)
    np.testing.assert_allclose(got[1], 0.5 * x[1] @ (a @ b), atol=1e-5)
    with pytest.raises(ValueError, match="adapter_ids"):
        lora_delta(x, {"a": A, "b": B}, None, None, jnp.float32)


@pytest.mark.parametrize("scan", [False, True])
def test_merge_equals_the_adapted_model(scan):
    m = adapted(LoRAConfig(rank=3, alpha=6, targets=("q", "o", "up", "down")), scan=scan)
    assert has_lora(m) and trainable_filter(m) is nnx.LoRAParam
    merged = merge_lora(m)
    assert not has_lora(merged) and trainable_filter(merged) is nnx.Param
    np.testing.assert_allclose(merged(T, POS, SEG), m(T, POS, SEG), atol=1e-5)


@pytest.mark.parametrize("scan", [False, True])
def test_bank_slots_give_each_row_its_adapter(scan):
    one = adapted(LoRAConfig(rank=2, alpha=4, targets=("k", "v", "gate")), seed=3)
    two = adapted(LoRAConfig(rank=4, alpha=4, rslora=True), seed=4, scan=True)
    base = BASE
    bank = with_base(Decoder(CONFIG.replace(lora=LoRAConfig(rank=4, slots=3), scan_layers=scan),
                             rngs=nnx.Rngs(0)))
    assert not np.any(np.asarray(bank.lora_scale[...]))
    write_slot(bank, 1, adapter_params(one), one.config.lora)
    write_slot(bank, 2, adapter_params(two), two.config.lora)  # stacked -> either layout
    got = bank(T, POS, SEG, adapter_ids=jnp.asarray([2, 1]))
    np.testing.assert_allclose(got[0], two(T, POS, SEG)[0], atol=1e-5)
    np.testing.assert_allclose(got[1], one(T, POS, SEG)[1], atol=1e-5)
    np.testing.assert_allclose(bank(T, POS, SEG), base(T, POS, SEG), atol=1e-5)  # slot 0
    with pytest.raises(ValueError, match="slot must be in 1..2"):
        write_slot(bank, 0, adapter_params(one), one.config.lora)
    with pytest.raises(ValueError, match="rank 8"):
        write_slot(bank, 1, adapter_params(one), dataclasses.replace(one.config.lora, rank=8))
    with pytest.raises(ValueError, match="no adapter bank"):
        base(T, POS, SEG, adapter_ids=jnp.asarray([1, 1]))


def test_lora_update_backward_equals_autodiff():
    """`lora_update`'s hand-written backward (token-axis dot_generals) gives autodiff's
    gradients for x, A and B, and its forward the plain product (fp32, 1e-5 relative)."""
    rng = np.random.default_rng(0)
    x, a, b, dy = (jnp.asarray(rng.normal(size=s), jnp.float32)
                   for s in ((2, 5, 12), (12, 4), (4, 7), (2, 5, 7)))

    def plain(x, a, b):
        return jnp.einsum("...r,ro->...o", jnp.einsum("...i,ir->...r", x, a), b) * 1.5

    np.testing.assert_allclose(lora_update(x, a, b, 1.5), plain(x, a, b), rtol=1e-5)
    got = jax.grad(lambda *p: (lora_update(*p, 1.5) * dy).sum(), argnums=(0, 1, 2))(x, a, b)
    want = jax.grad(lambda *p: (plain(*p) * dy).sum(), argnums=(0, 1, 2))(x, a, b)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
