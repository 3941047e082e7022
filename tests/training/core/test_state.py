"""OptimizerConfig (schedule, clipping, decay mask) and the functional train state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ac2_jax.training.core.state import (OptimizerConfig, TrainState, as_transform, create_train_state,
                                    num_params)


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
