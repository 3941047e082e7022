"""OptimizerConfig (schedule, clipping, decay mask) and the functional train state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ac2_jax.training.core.state import (
    OptimizerConfig,
    TrainState,
    as_transform,
    create_train_state,
    num_params,
)


class Tiny(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (3, 4)))
        self.b = nnx.Param(jnp.zeros((4,)))
        self.scale = nnx.Variable(jnp.ones(()))  # not a Param: carried, never trained

    def __call__(self, x):
        return (x @ self.w[...] + self.b[...]) * self.scale[...]


def test_warmup_then_constant():
    lr = OptimizerConfig(learning_rate=1.0, warmup_steps=4).lr_schedule()
    np.testing.assert_allclose([float(lr(s)) for s in range(6)],
                               [0.25, 0.5, 0.75, 1.0, 1.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(float(OptimizerConfig(learning_rate=0.3).lr_schedule()(0)), 0.3)


def test_warmup_then_cosine_to_floor():
    cfg = OptimizerConfig(learning_rate=2.0, schedule="cosine", warmup_steps=2, total_steps=12,
                          end_lr_ratio=0.1)
    lr = cfg.lr_schedule()
    np.testing.assert_allclose(float(lr(0)), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(lr(2)), 2.0, rtol=1e-6)
    np.testing.assert_allclose(float(lr(7)), 2.0 * (0.1 + 0.9 * 0.5), rtol=1e-5)  # halfway
    np.testing.assert_allclose(float(lr(12)), 0.2, rtol=1e-5)
    np.testing.assert_allclose(float(lr(100)), 0.2, rtol=1e-5)


@pytest.mark.parametrize("kw,match", [
    (dict(schedule="linear"), "schedule must be one of"),
    (dict(schedule="cosine"), "total_steps"),
    (dict(schedule="cosine", warmup_steps=5, total_steps=5), "total_steps"),
    (dict(learning_rate=-1.0), "learning_rate"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(clip_norm=0.0), "clip_norm"),
])
def test_bad_config_is_named(kw, match):
    with pytest.raises(ValueError, match=match):
        OptimizerConfig(**kw)


def test_weight_decay_only_on_matrices():
    params = {"w": jnp.ones((2, 2)), "b": jnp.ones((2,))}
    tx = OptimizerConfig(learning_rate=0.1, weight_decay=0.5).build()
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_allclose(new["w"], 1.0 - 0.1 * 0.5, rtol=1e-6)
    np.testing.assert_allclose(new["b"], 1.0)


def test_global_norm_clipping():
    # With eps >> |g| Adam's first step is ~lr * g / eps: linear in g, so clipping shows.
    params = {"w": jnp.zeros((4,))}
    grads = {"w": jnp.asarray([3.0, 4.0, 0.0, 0.0])}  # norm 5
    step = lambda cfg: optax.apply_updates(  # noqa: E731
        params, cfg.build().update(grads, cfg.build().init(params), params)[0])["w"]
    clipped = step(OptimizerConfig(learning_rate=1.0, eps=1e6, clip_norm=1.0))
    free = step(OptimizerConfig(learning_rate=1.0, eps=1e6, clip_norm=None))
    np.testing.assert_allclose(clipped * 5.0, free, rtol=1e-3)
    assert np.abs(free).max() > 0


def test_create_train_state_splits_params_from_the_rest():
    model = Tiny(nnx.Rngs(0))
    graphdef, state = create_train_state(model, OptimizerConfig(), rng=7)
    assert isinstance(state, TrainState) and int(state.step) == 0
    assert set(state.params.keys()) == {"w", "b"} and set(state.rest.keys()) == {"scale"}
    np.testing.assert_array_equal(state.rng, jax.random.PRNGKey(7))
    assert num_params(state.params) == 16
    x = jnp.ones((2, 3))
    np.testing.assert_allclose(state.model(graphdef)(x), model(x), rtol=1e-6)
    _, typed = create_train_state(model, OptimizerConfig(), rng=jax.random.key(7))
    np.testing.assert_array_equal(typed.rng, state.rng)
    assert typed.rng.dtype == jnp.uint32


def test_model_without_params_and_bad_optimizer_are_errors():
    class NoParams(nnx.Module):
        def __init__(self):
            self.v = nnx.Variable(jnp.ones(()))

    with pytest.raises(ValueError, match="no nnx.Param"):
        create_train_state(NoParams(), OptimizerConfig())
    with pytest.raises(TypeError, match="OptimizerConfig"):
        as_transform({"lr": 1e-3})


@pytest.fixture(scope="module")
def lora_pair():
    """A LoRA model with a bf16 base and the same model with that base held in fp32
    (the same values), both with non-zero adapters; 4 scanned layers. Built once for
    the module (the tests only read them), and both tests compile the same two steps
    (one row of 32 tokens), so the second reads them from the run's compile cache."""
    layers = 4
    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.models.lora import LoRAConfig

    def build(base):
        c = DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=256,
                          num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
                          scan_layers=True, remat="full",
                          lora=LoRAConfig(rank=4, alpha=8, base_dtype=base))
        m = Decoder(c, rngs=nnx.Rngs(0))
        rng = np.random.default_rng(1)
        for _, v in nnx.to_flat_state(nnx.state(m, nnx.LoRAParam)):
            v.set_value(jnp.asarray(rng.normal(size=v.shape, scale=0.1), v.dtype))
        return m

    half, full = build("bfloat16"), build(None)
    for (_, a), (_, b) in zip(nnx.to_flat_state(nnx.state(half, nnx.Param)),
                              nnx.to_flat_state(nnx.state(full, nnx.Param)), strict=True):
        if a.get_value().dtype == jnp.bfloat16:
            b.set_value(a.get_value().astype(jnp.float32))
    return half, full


def test_a_bf16_base_lives_in_the_train_state_as_bits(lora_pair):
    """A LoRA train state holds the frozen bf16 layer stacks as uint16 bits (the step
    slices them with no copy), the embedding and adapters as they are; `model()` gives
    the bf16 weights back exactly; the abstract state agrees; one step of it equals the
    same step over an fp32 base of the same values (fp32 compute: loss 1e-5 relative,
    updated adapters 1e-3 of the learning rate)."""
    from ac2_jax.models import Decoder
    from ac2_jax.segments import pack_segments
    from ac2_jax.training import PolicyGradientLoss, make_train_step
    from ac2_jax.training.core import abstract_train_state
    from ac2_jax.training.rl import rl_segment

    half, full = lora_pair
    opt = OptimizerConfig(learning_rate=1e-2)
    graphdef, state = create_train_state(half, opt)
    rest = dict(nnx.to_flat_state(state.rest))
    assert rest[("layers", "mlp", "gate_proj")].get_value().dtype == jnp.uint16
    assert rest[("embed_tokens",)].get_value().dtype == jnp.bfloat16
    params = dict(nnx.to_flat_state(state.params))
    assert params[("layers", "mlp", "gate_lora", "a")].get_value().dtype == jnp.float32
    back = state.model(graphdef)
    for (_, a), (_, b) in zip(nnx.to_flat_state(nnx.state(half)), nnx.to_flat_state(nnx.state(back)),
                              strict=True):
        assert a.get_value().dtype == b.get_value().dtype
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))
    _, abstract = abstract_train_state(lambda: Decoder(half.config, rngs=nnx.Rngs(0)), opt)
    assert (jax.tree.map(lambda x: (x.shape, x.dtype), abstract.rest)
            == jax.tree.map(lambda x: (x.shape, x.dtype), state.rest))

    ids = np.random.default_rng(0).integers(0, 128, 32)
    seg = rl_segment(ids, np.r_[np.zeros(16), np.ones(16)], np.full(32, -1.0), task="t0",
                     advantage=1.0)
    batch = pack_segments([seg], 32)
    out = []
    for m in (half, full):
        gd, st = create_train_state(m, opt)
        step = make_train_step(gd, PolicyGradientLoss(mode="task_mean"), opt)
        st, metrics = step(step.place(st), batch)
        out.append((float(metrics["loss"]), st.params))
    assert abs(out[0][0] - out[1][0]) <= 1e-5 * abs(out[1][0])
    for a, b in zip(jax.tree.leaves(out[0][1]), jax.tree.leaves(out[1][1]), strict=True):
        # Adam's first update is about lr * g / |g|: ties near g = 0 move by ~1e-4 lr.
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-3 * 1e-2)


def test_a_bf16_base_step_holds_no_copy_of_the_layer_stacks(lora_pair):
    """With the bits in the state, the compiled step of a bf16-base LoRA model holds no
    16-bit copy of the layer stacks (which turning them into bits inside the step
    costs on XLA:CPU): its temporaries exceed the fp32 base's by less than a quarter
    of the fp32 stacks' bytes (the copy alone would be half)."""
    from ac2_jax.segments import pack_segments
    from ac2_jax.training import PolicyGradientLoss, make_train_step
    from ac2_jax.training.rl import rl_segment

    half, full = lora_pair
    opt = OptimizerConfig(learning_rate=1e-2)
    batch = pack_segments([rl_segment(np.arange(32) % 128, np.r_[np.zeros(16), np.ones(16)],
                                      np.full(32, -1.0), task="t0", advantage=1.0)], 32)
    temps = []
    for m in (half, full):
        gd, st = create_train_state(m, opt)
        step = make_train_step(gd, PolicyGradientLoss(mode="task_mean"), opt)
        ma = step.lower(step.place(st), batch, None).compile().memory_analysis()
        temps.append(ma.temp_size_in_bytes)
    stacks = 4 * sum(x.size for x in jax.tree.leaves(nnx.state(full.layers, nnx.Param)))
    assert temps[0] - temps[1] < 0.25 * stacks, (temps, stacks)
