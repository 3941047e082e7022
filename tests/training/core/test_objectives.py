"""Loss weights reproduce aggregate_loss exactly (any mode, split or pmapped); loss fns;
the chunked (hidden states + head) path of the loss fns equals the dense one (1e-5)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ac2_jax.losses import (MODES, aggregate_loss, policy_gradient_loss, policy_gradient_metrics,
                            token_entropy, token_logprobs)
from ac2_jax.segments import pack_segments
from ac2_jax.training.rl import rl_segment
from ac2_jax.losses import loss_weights
from ac2_jax.training.core.objectives import (PolicyGradientLoss, SFTLoss, StepModel, apply_loss,
                                              lm_head_of)

N_DEV = 8


def make_batch(seed=0, rows_multiple=8):
    rng = np.random.default_rng(seed)
    segs = []
    for t in range(4):
        for _ in range(int(rng.integers(1, 4))):
            n = int(rng.integers(4, 12))
            mask = (rng.random(n) > 0.3).astype(np.float32)
            segs.append(rl_segment(rng.integers(0, 30, n), mask, -rng.random(n), task=f"task{t}",
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
    old_lp = {"detached": logp, "sampler": batch.features["sampler_logprobs"],
              "extras": extras["old_logprobs"]}[old]
    fn = PolicyGradientLoss(old_logprobs=old, clip_eps=0.1)
    per_token, sums = fn(logits, batch, extras)
    want = policy_gradient_loss(logp, old_lp, batch.features["sampler_logprobs"], batch.features["advantages"],
                                batch.loss_mask, clip_eps=0.1)
    np.testing.assert_allclose(per_token, want, rtol=1e-6, atol=1e-7)
    means = policy_gradient_metrics(logp, old_lp, batch.features["sampler_logprobs"], batch.loss_mask,
                                    batch.features["advantages"], 0.1)
    n = float(batch.loss_mask.sum())
    for k in ("clip_frac", "kl_to_sampler"):
        np.testing.assert_allclose(float(sums[k]) / n, float(means[k]), rtol=1e-5)
    if old == "detached":
        # The ratio is 1 everywhere, so the gradient is the plain PG gradient -A * w * dlogp.
        g = jax.grad(lambda lg: (fn(lg, batch)[0]).sum())(logits)
        w = jnp.minimum(jnp.exp(logp - batch.features["sampler_logprobs"]), 2.0)
        coef = jnp.where(batch.loss_mask > 0, -batch.features["advantages"] * w, 0.0)
        g_want = jax.grad(lambda lg: (coef * token_logprobs(lg, batch.targets)).sum())(logits)
        np.testing.assert_allclose(g, g_want, rtol=1e-5, atol=1e-7)


def test_policy_gradient_extras_missing_is_an_error():
    batch = make_batch()
    logits = jnp.zeros((*batch.shape, 30))
    with pytest.raises(ValueError, match="extras"):
        PolicyGradientLoss(old_logprobs="extras")(logits, batch, None)


# ----------------------------------------------------------------------------- chunked path


def _tiny_model(tie: bool):
    from flax import nnx

    from ac2_jax.models import Decoder, DecoderConfig
    model = Decoder(DecoderConfig.tiny(vocab_size=30, num_layers=1, tie_embeddings=tie),
                    rngs=nnx.Rngs(1))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return model, graphdef, params, rest


@pytest.mark.parametrize("tie", [True, False])
def test_lm_head_of_projects_like_the_model(tie):
    model, *_ = _tiny_model(tie)
    h = jnp.asarray(np.random.default_rng(6).normal(size=(2, 5, 32)), jnp.float32)
    head = lm_head_of(model)
    assert head.layout == ("vd" if tie else "dv") and head.vocab_size == 30
    np.testing.assert_array_equal(head.logits(h), model.logits(h))
    with pytest.raises(TypeError, match="CausalLM"):
        lm_head_of(object())


def _sampled_batch():
    """make_batch with per-token sampling parameters (some top-k / top-p filtered)."""
    batch = make_batch()
    rng = np.random.default_rng(7)
    return batch.replace(temperature=rng.uniform(0.6, 1.4, batch.shape).astype(np.float32),
                         top_k=rng.choice([0, 2, 5], batch.shape).astype(np.int32),
                         top_p=rng.choice([1.0, 0.8], batch.shape).astype(np.float32))


def test_chunked_losses_equal_dense_values_and_grads():
    """SFTLoss / PolicyGradientLoss with chunk_size (hidden states + head, 7 positions at
    a time) give the dense per-token losses, metric sums and param gradients (1e-5)."""
    _, graphdef, params, rest = _tiny_model(tie=True)
    batch = _sampled_batch()
    batch = batch.replace(features={**batch.features,
                                    "sampler_logprobs": -np.abs(batch.features["sampler_logprobs"])})
    w = loss_weights(batch, "task_mean")
    pairs = [(SFTLoss(), SFTLoss(chunk_size=7)),
             (PolicyGradientLoss(old_logprobs="sampler"),
              PolicyGradientLoss(old_logprobs="sampler", chunk_size=7))]

    @jax.jit
    def run(p):
        out = []
        for dense, chunked in pairs:
            for fn in (dense, chunked):
                def f(p):
                    per_token, sums = apply_loss(fn, StepModel(graphdef, p, rest), batch, None)
                    return (w * per_token).sum(), (per_token, sums)
                (_, aux), g = jax.value_and_grad(f, has_aux=True)(p)
                out.append((aux, g))
        return out

    out = run(params)
    for (want, g_want), (got, g_got) in zip(out[0::2], out[1::2]):
        for a, b in zip(jax.tree.leaves((got, g_got)), jax.tree.leaves((want, g_want))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert set(out[3][0][1]) == {"entropy", "clip_frac", "kl_to_sampler"}
    # the dense from_model is the logits call: the same ops as before
    logits = StepModel(graphdef, params, rest).logits(batch)
    np.testing.assert_array_equal(apply_loss(SFTLoss(), StepModel(graphdef, params, rest),
                                             batch, None)[0], SFTLoss()(logits, batch)[0])
    with pytest.raises(ValueError, match="chunk_size must be None"):
        SFTLoss(chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size must be None"):
        PolicyGradientLoss(chunk_size=2.5)
