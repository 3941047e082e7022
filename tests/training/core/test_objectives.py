"""Loss weights reproduce aggregate_loss exactly (any mode, split or pmapped); loss fns;
the chunked (hidden states + head) path of the loss fns equals the dense one (1e-5)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ac2_jax.losses import (
    MODES,
    aggregate_loss,
    loss_weights,
    policy_gradient_loss,
    policy_gradient_metrics,
    token_entropy,
    token_logprobs,
)
from ac2_jax.segments import pack_segments
from ac2_jax.training.core.objectives import (
    PolicyGradientLoss,
    SFTLoss,
    StepModel,
    apply_loss,
    lm_head_of,
)
from ac2_jax.training.rl import rl_segment

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
        if k == "clip_frac" and old == "detached":  # r = 1: a clip that cannot bind
            assert k not in sums
            continue
        np.testing.assert_allclose(float(sums[k]) / n, float(means[k]), rtol=1e-5)
    if old == "detached":
        # The ratio is 1 everywhere, so the gradient is the plain PG gradient -A * w * dlogp.
        g = jax.grad(lambda lg: (fn(lg, batch)[0]).sum())(logits)
        w = jnp.minimum(jnp.exp(logp - batch.features["sampler_logprobs"]), 2.0)
        coef = jnp.where(batch.loss_mask > 0, -batch.features["advantages"] * w, 0.0)
        g_want = jax.grad(lambda lg: (coef * token_logprobs(lg, batch.targets)).sum())(logits)
        np.testing.assert_allclose(g, g_want, rtol=1e-5, atol=1e-7)


def test_policy_gradient_metrics_name_the_bounds_that_can_bind():
    """Issue 61, finding 4: clip_frac is never reported where it cannot be non-zero. The
    default (old_logprobs="detached", one update per batch: r = 1) is bounded by TIS alone
    and reports tis_frac; the trust region against the sampler (old_logprobs="sampler")
    reports clip_frac and, with dual_clip, dual_clip_frac, and no tis_frac (its weight is
    1); "extras" (several updates on one batch) reports all three."""
    batch = make_batch()
    logits = jnp.asarray(np.random.default_rng(6).normal(size=(*batch.shape, 30)), jnp.float32)
    logp = token_logprobs(logits, batch.targets)
    extras = {"old_logprobs": logp + 0.5}
    cases = [(PolicyGradientLoss(), {"tis_frac"}),
             (PolicyGradientLoss(tis_cap=None), set()),
             (PolicyGradientLoss(old_logprobs="sampler"), {"clip_frac"}),
             (PolicyGradientLoss(old_logprobs="sampler", dual_clip=3.0),
              {"clip_frac", "dual_clip_frac"}),
             (PolicyGradientLoss(old_logprobs="extras", dual_clip=3.0),
              {"clip_frac", "dual_clip_frac", "tis_frac"})]
    sampler, adv = batch.features["sampler_logprobs"], batch.features["advantages"]
    n = float(batch.loss_mask.sum())
    for fn, bounds in cases:
        _, sums = fn(logits, batch, extras)
        assert set(sums) == {"entropy", "kl_to_sampler"} | bounds, (fn, set(sums))
        old = {"detached": logp, "sampler": sampler, "extras": extras["old_logprobs"]}[
            fn.old_logprobs]
        means = policy_gradient_metrics(logp, old, sampler, batch.loss_mask, adv,
                                        clip_eps=fn.clip_eps, dual_clip=fn.dual_clip,
                                        tis_cap=fn.tis_cap)
        for k in bounds:
            np.testing.assert_allclose(float(sums[k]) / n, float(means[k]), rtol=1e-5)
    # Sampled log-probs 2 nats below the learner's (ratio e^2 > 3) on every other position
    # and 2 above on the rest: each bound binds somewhere.
    shift = np.where(np.arange(batch.shape[1]) % 2, 2.0, -2.0).astype(np.float32)
    batch = batch.replace(features={**batch.features,
                                    "sampler_logprobs": np.asarray(logp) - shift})
    _, sums = PolicyGradientLoss(old_logprobs="sampler", dual_clip=3.0)(logits, batch, None)
    assert float(sums["clip_frac"]) > 0 and float(sums["dual_clip_frac"]) > 0
    _, sums = PolicyGradientLoss()(logits, batch, None)
    assert float(sums["tis_frac"]) > 0


def test_a_bound_that_cannot_bind_is_refused():
    with pytest.raises(ValueError, match="dual_clip.*detached"):
        PolicyGradientLoss(dual_clip=3.0)  # r = 1: the dual clip never binds
    with pytest.raises(ValueError, match="dual_clip"):
        PolicyGradientLoss(old_logprobs="sampler", dual_clip=1.0)
    with pytest.raises(ValueError, match="tis_cap"):
        PolicyGradientLoss(tis_cap=0.5)


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


# ----------------------------------------------------------------- grammar-constrained tokens


@functools.cache
def _constrained_model():
    """The tiny untied model of these tests, built once: (model, graphdef, params, rest)."""
    return _tiny_model(tie=False)


@functools.cache
def _constrained_segments(seed: int = 11, V: int = 30):
    """6 segments of 3 tasks sharing 2 prompts (so the tree merges) whose outputs the
    model samples token by token as the sampler does: per-token temperature / top_k /
    top_p, and at about 60% of the output tokens a hand-made grammar mask (random, ~40%
    of the vocabulary) applied first; the sampler log-probs are recorded
    (log_softmax(sampling_logits(masked logits))[token])."""
    from ac2_jax.losses import sampling_logits
    from ac2_jax.segments import pack_mask_bits
    model = _constrained_model()[0]

    @jax.jit
    def draw(tokens, n, allowed, t, k, p, key):
        logits = model(tokens[None], jnp.arange(16)[None], (jnp.arange(16) < n)[None] * 1)[0, n - 1]
        z = sampling_logits(jnp.where(allowed, logits, -jnp.inf), t, k, p)
        tok = jax.random.categorical(key, z)
        return tok, jax.nn.log_softmax(z)[tok]

    rng = np.random.default_rng(seed)
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    prompts = [rng.integers(0, V, 5) for _ in range(2)]
    segs = []
    for i in range(6):
        toks, lps, ids, masks = list(prompts[i % 2]), [0.0] * 5, [0] * 5, []
        n = 5 + int(rng.integers(3, 7))
        t = rng.choice([0.7, 1.0, 1.3], n).astype(np.float32)
        k = rng.choice([0, 4, 12], n).astype(np.int32)
        p = rng.choice([1.0, 0.85], n).astype(np.float32)
        while len(toks) < n:
            j = len(toks)
            allowed, constrained = np.ones(V, bool), rng.random() < 0.6
            if constrained:
                allowed = rng.random(V) < 0.4
                allowed[rng.integers(V)] = True
                masks.append(allowed)
            tok, lp = draw(jnp.asarray(np.r_[toks, np.zeros(16 - j)], jnp.int32), j, allowed,
                           t[j], k[j], p[j], next(keys))
            toks.append(int(tok))
            lps.append(float(lp))
            ids.append(len(masks) if constrained else 0)
        mask = (np.arange(n) >= 5).astype(np.float32)
        seg = rl_segment(np.asarray(toks), mask, np.asarray(lps), task=f"t{i % 3}",
                         advantage=float(rng.normal()), temperature=t, top_k=k, top_p=p)
        segs.append(seg.with_constraints(np.asarray(ids, np.int32),
                                         pack_mask_bits(np.asarray(masks, bool).reshape(-1, V))))
    return tuple(segs)


def _constrained_batch(layout: str, seed: int = 11):
    """`_constrained_segments` packed `layout` (rows of 64, a table of 32 masks)."""
    return pack_segments(list(_constrained_segments(seed)), 64, layout=layout, rows_multiple=2,
                         min_masks=32)


def _unconstrained(batch):
    """The same batch with its grammar masks dropped (today's unmasked re-score)."""
    from ac2_jax.segments import CONSTRAINT_ID
    return batch.replace(constraint_masks=None,
                         features={k: v for k, v in batch.features.items() if k != CONSTRAINT_ID})


def _masked_reference(logits, batch):
    """log_softmax(sampling_logits(masked logits))[target] per position, as the sampler
    records it (numpy masks from the batch's table)."""
    from ac2_jax.losses import sampling_logits
    from ac2_jax.segments import CONSTRAINT_ID, unpack_mask_bits
    ids = batch.features[CONSTRAINT_ID]
    masks = unpack_mask_bits(batch.constraint_masks, logits.shape[-1])
    allowed = np.where(ids[..., None] > 0, masks[np.maximum(ids - 1, 0)], True)
    z = sampling_logits(jnp.where(allowed, logits, -jnp.inf), batch.temperature, batch.top_k,
                        batch.top_p)
    lp = jax.nn.log_softmax(z, axis=-1)
    return np.asarray(jnp.take_along_axis(lp, batch.targets[..., None], axis=-1)[..., 0])


@pytest.mark.parametrize("layout", ["flat", "tree"])
@pytest.mark.parametrize("chunk_size", [None, 7])
def test_constrained_tokens_are_scored_under_their_masks(layout, chunk_size):
    """model_logprobs (behaviour: what PolicyGradientLoss and TrainStep.logprobs use), dense
    and chunked: a constrained position's log-prob is the masked sampling distribution's
    (fp32, atol 1e-6); every other position and the entropy are bit for bit the unmasked."""
    from ac2_jax.segments import CONSTRAINT_ID
    from ac2_jax.training.core.objectives import model_logprobs
    model, graphdef, params, rest = _constrained_model()
    batch = _constrained_batch(layout)
    ids = batch.features[CONSTRAINT_ID]
    on, off = (ids > 0) & (batch.loss_mask > 0), (ids == 0) & (batch.segment_ids > 0)
    assert on.sum() >= 10 and batch.constraint_masks.shape == (32, 1)
    if layout == "tree":  # shared prompts merged
        assert batch.num_real_tokens < _constrained_batch("flat").num_real_tokens

    @jax.jit
    def run(b):
        m = StepModel(graphdef, params, rest)
        lp, ent = model_logprobs(m, b, behaviour=True, entropy=True, chunk_size=chunk_size)
        if chunk_size is None:
            logits = m.logits(b)
        else:
            h = m.hidden(b.tokens, b.positions, b.segment_ids, b.subtree_end)
            logits = jax.vmap(lambda x: m.head().logits(x))(h)
        return lp, ent, logits

    lp, ent, logits = run(batch)
    lp0, ent0, _ = run(_unconstrained(batch))
    np.testing.assert_allclose(np.asarray(lp)[on], _masked_reference(logits, batch)[on],
                               rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(lp)[off], np.asarray(lp0)[off])
    np.testing.assert_array_equal(np.asarray(ent), np.asarray(ent0))
    assert np.abs(np.asarray(lp0)[on] - np.asarray(lp)[on]).max() > 0.05  # masks matter here


@pytest.mark.parametrize("chunk_size", [None, 7])
def test_on_policy_ratios_are_1_under_the_masks(chunk_size):
    """Tokens sampled under masks with the sampler's log-probs recorded, re-scored by the
    same weights: the PPO ratio exp(logp - sampler_logp) is 1 (|r - 1| < 1e-5, fp32) at
    every trained position, clip_frac 0, kl_to_sampler ~0; the unmasked re-score (today's)
    is far from 1 at the constrained ones."""
    from ac2_jax.segments import CONSTRAINT_ID
    from ac2_jax.training.core.objectives import model_logprobs
    model, graphdef, params, rest = _constrained_model()
    batch = _constrained_batch("flat", seed=12)
    m = StepModel(graphdef, params, rest)
    sampler = batch.features["sampler_logprobs"]
    loss = PolicyGradientLoss(old_logprobs="sampler", chunk_size=chunk_size)
    trained = batch.loss_mask > 0
    on = trained & (batch.features[CONSTRAINT_ID] > 0)


    @jax.jit  # one compile per batch structure, not one per op
    def score(b):
        lp, _ = model_logprobs(m, b, behaviour=True, entropy=False, chunk_size=chunk_size)
        return lp, apply_loss(loss, m, b, None)[1]

    for b, ok in ((batch, True), (_unconstrained(batch), False)):
        lp, sums = score(b)
        ratio = np.exp(np.asarray(lp) - sampler)
        if ok:
            assert np.abs(ratio[trained] - 1).max() < 1e-5
            assert float(sums["clip_frac"]) == 0 and abs(float(sums["kl_to_sampler"])) < 1e-5
        else:
            assert np.abs(ratio[on] - 1).max() > 0.1 and float(sums["kl_to_sampler"]) > 1e-3


def test_a_batch_without_masks_traces_the_same_ops_as_before():
    """No table (constraint_masks None): behaviour_logprobs is today's token_logprobs call,
    op for op (same jaxpr), and the batch has no leaf beyond the [rows, seq_len] ones."""
    from ac2_jax.training.core.objectives import behaviour_logprobs
    batch = _unconstrained(_constrained_batch("flat"))
    assert all(x.shape == batch.shape for x in jax.tree.leaves(batch))
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(*batch.shape, 30)), jnp.float32)

    def today(lg, b):
        return token_logprobs(lg, b.targets, temperature=b.temperature, top_k=b.top_k,
                              top_p=b.top_p)

    assert str(jax.make_jaxpr(behaviour_logprobs)(logits, batch)) == str(
        jax.make_jaxpr(today)(logits, batch))


def test_a_table_without_ids_is_an_error():
    from ac2_jax.training.core.objectives import behaviour_logprobs
    batch = _constrained_batch("flat")
    bad = batch.replace(features={k: v for k, v in batch.features.items() if k != "constraint_id"})
    with pytest.raises(ValueError, match="no feature 'constraint_id'"):
        behaviour_logprobs(jnp.zeros((*batch.shape, 30)), bad)
