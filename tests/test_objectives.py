"""Loss weights reproduce aggregate_loss exactly (any mode, split or pmapped); loss fns."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ac2_jax.losses import (MODES, aggregate_loss, policy_gradient_loss, policy_gradient_metrics,
                            token_entropy, token_logprobs)
from ac2_jax.segments import Segment, pack_segments
from ac2_jax.training.core.objectives import PolicyGradientLoss, SFTLoss, loss_weights

N_DEV = 8


def make_batch(seed=0, rows_multiple=8):
    rng = np.random.default_rng(seed)
    segs = []
    for t in range(4):
        for _ in range(int(rng.integers(1, 4))):
            n = int(rng.integers(4, 12))
            mask = (rng.random(n) > 0.3).astype(np.float32)
            segs.append(Segment(rng.integers(0, 30, n), mask, -rng.random(n), task=f"task{t}",
                                advantage=float(rng.normal()), weight=float(rng.uniform(0.5, 2))))
    return pack_segments(segs, 12, rows_multiple=rows_multiple)


@pytest.mark.parametrize("mode", MODES)
def test_weights_reproduce_aggregate_loss(mode):
    batch = make_batch()
    per_token = jnp.asarray(np.random.default_rng(1).normal(size=batch.shape), jnp.float32)
    w = loss_weights(batch, mode, normalizer=7.0 if mode == "constant" else None)
    want = aggregate_loss(per_token, batch, mode, normalizer=7.0 if mode == "constant" else None)
    np.testing.assert_allclose(float((w * per_token).sum()), float(want), rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_weights_under_pmap_sum_to_the_global_loss(mode):
    batch = make_batch(seed=2)
    per_token = np.random.default_rng(3).normal(size=batch.shape).astype(np.float32)
    split = lambda x: np.asarray(x).reshape(N_DEV, -1, *np.shape(x)[1:])  # noqa: E731

    norm = 7.0 if mode == "constant" else None

    def local(pt, b):
        return jax.lax.psum((loss_weights(b, mode, normalizer=norm, axis_name="d") * pt).sum(), "d")

    got = jax.pmap(local, axis_name="d", devices=jax.devices()[:N_DEV])(
        split(per_token), jax.tree.map(split, batch))
    want = aggregate_loss(jnp.asarray(per_token), batch, mode, normalizer=norm)
    np.testing.assert_allclose(np.asarray(got), float(want), rtol=1e-6)


def test_bad_mode_is_named():
    with pytest.raises(ValueError, match="mode must be one of"):
        loss_weights(make_batch(), "mean_of_means")
    with pytest.raises(ValueError, match="SFTLoss.mode"):
        SFTLoss(mode="sum")
    with pytest.raises(ValueError, match="old_logprobs"):
        PolicyGradientLoss(old_logprobs="learner")


def test_sft_loss_is_nll_with_masked_entropy_sum():
    batch = make_batch()
    logits = jnp.asarray(np.random.default_rng(4).normal(size=(*batch.shape, 30)), jnp.float32)
    per_token, sums = SFTLoss()(logits, batch)
    np.testing.assert_allclose(per_token, -token_logprobs(logits, batch.targets), rtol=1e-6)
    np.testing.assert_allclose(sums["entropy"],
                               (token_entropy(logits) * batch.loss_mask).sum(), rtol=1e-5)


@pytest.mark.parametrize("old", ["detached", "sampler", "extras"])
def test_policy_gradient_loss_sources_of_old_logprobs(old):
    batch = make_batch()
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(size=(*batch.shape, 30)), jnp.float32)
    logp = token_logprobs(logits, batch.targets)
    extras = {"old_logprobs": logp + 0.1 * jnp.asarray(rng.normal(size=batch.shape), jnp.float32)}
    old_lp = {"detached": logp, "sampler": batch.sampler_logprobs,
              "extras": extras["old_logprobs"]}[old]
    fn = PolicyGradientLoss(old_logprobs=old, clip_eps=0.1)
    per_token, sums = fn(logits, batch, extras)
    want = policy_gradient_loss(logp, old_lp, batch.sampler_logprobs, batch.advantages,
                                batch.loss_mask, clip_eps=0.1)
    np.testing.assert_allclose(per_token, want, rtol=1e-6, atol=1e-7)
    means = policy_gradient_metrics(logp, old_lp, batch.sampler_logprobs, batch.loss_mask,
                                    batch.advantages, 0.1)
    n = float(batch.loss_mask.sum())
    for k in ("clip_frac", "kl_to_sampler"):
        np.testing.assert_allclose(float(sums[k]) / n, float(means[k]), rtol=1e-5)
    if old == "detached":
        # The ratio is 1 everywhere, so the gradient is the plain PG gradient -A * w * dlogp.
        g = jax.grad(lambda lg: (fn(lg, batch)[0]).sum())(logits)
        w = jnp.minimum(jnp.exp(logp - batch.sampler_logprobs), 2.0)
        coef = jnp.where(batch.loss_mask > 0, -batch.advantages * w, 0.0)
        g_want = jax.grad(lambda lg: (coef * token_logprobs(lg, batch.targets)).sum())(logits)
        np.testing.assert_allclose(g, g_want, rtol=1e-5, atol=1e-7)


def test_policy_gradient_extras_missing_is_an_error():
    batch = make_batch()
    logits = jnp.zeros((*batch.shape, 30))
    with pytest.raises(ValueError, match="extras"):
        PolicyGradientLoss(old_logprobs="extras")(logits, batch, None)
