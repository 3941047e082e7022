"""group_advantages and policy_gradient_loss: formulas, gradients, multi-device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ac2_jax.losses import group_advantages, policy_gradient_loss, policy_gradient_metrics
from tests.support.multidevice import run_mesh_rows, run_pmap_replicated, run_pmap_rows


def test_group_advantages():
    r = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.5], np.float32)
    g = np.array([0, 0, 0, 1, 1, 2])
    a = np.asarray(group_advantages(r, g))
    np.testing.assert_allclose(a, [2 / 3, -1 / 3, -1 / 3, 0, 0, 0], atol=1e-6)
    a_std = np.asarray(group_advantages(r, g, normalize_std=True))
    std0 = np.std([1.0, 0.0, 0.0])
    np.testing.assert_allclose(a_std[:3], np.array([2 / 3, -1 / 3, -1 / 3]) / (std0 + 1e-6), rtol=1e-5)
    np.testing.assert_allclose(a_std[3:], 0.0, atol=1e-6)


def _inputs(seed=0, shape=(8, 6)):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.0, 0.3, shape).astype(np.float32)
    old = logp + rng.normal(0, 0.3, shape).astype(np.float32)
    samp = old + rng.normal(0, 0.5, shape).astype(np.float32)
    adv = rng.normal(0, 1, shape).astype(np.float32)
    mask = (rng.random(shape) < 0.7).astype(np.float32)
    return logp, old, samp, adv, mask


def _reference(logp, old, samp, adv, mask, eps_lo, eps_hi, cap):
    r = np.exp(logp - old)
    l = -np.minimum(r * adv, np.clip(r, 1 - eps_lo, 1 + eps_hi) * adv)
    if cap is not None:
        l = l * np.minimum(np.exp(old - samp), cap)
    return np.where(mask > 0, l, 0.0)


def test_matches_formula_symmetric_and_asymmetric_clip():
    args = _inputs()
    got = policy_gradient_loss(*args, clip_eps=0.2, tis_cap=2.0)
    np.testing.assert_allclose(got, _reference(*args, 0.2, 0.2, 2.0), rtol=1e-6, atol=1e-7)
    got = policy_gradient_loss(*args, clip_eps=(0.2, 0.28), tis_cap=None)
    np.testing.assert_allclose(got, _reference(*args, 0.2, 0.28, None), rtol=1e-6, atol=1e-7)


def test_on_policy_gradient_is_advantage_times_score():
    # With logp == old_logp the PPO loss gradient is -A * w per token.
    logp, _, samp, adv, mask = _inputs(1)
    grad = jax.grad(lambda lp: policy_gradient_loss(lp, logp, samp, adv, mask, tis_cap=3.0).sum())(logp)
    w = np.minimum(np.exp(logp - samp), 3.0)
    np.testing.assert_allclose(grad, np.where(mask > 0, -adv * w, 0), rtol=1e-5, atol=1e-6)


def test_metrics():
    logp, old, samp, adv, mask = _inputs(2)
    m = policy_gradient_metrics(logp, old, samp, mask, adv, clip_eps=0.2)
    r = np.exp(logp - old)
    # Only the side of the clip that removes gradient counts: r > 1.2 with A > 0, r < 0.8 with A < 0.
    frac = ((((r > 1.2) & (adv > 0)) | ((r < 0.8) & (adv < 0))) * mask).sum() / mask.sum()
    np.testing.assert_allclose(m["clip_frac"], frac, rtol=1e-6)
    assert float(m["kl_to_sampler"]) >= 0.0


def test_clip_frac_ignores_the_side_without_effect():
    """r = 1.5 with A < 0 and r = 0.5 with A > 0 are not clipped by the min: the gradient flows."""
    logp = jnp.log(jnp.array([1.5, 0.5, 1.5, 0.5]))
    old = jnp.zeros(4)
    adv = jnp.array([-1.0, 1.0, 1.0, -1.0])
    m = policy_gradient_metrics(logp, old, old, jnp.ones(4), adv, clip_eps=0.2)
    np.testing.assert_allclose(float(m["clip_frac"]), 0.5, rtol=1e-6)
    g = jax.grad(lambda lp: policy_gradient_loss(lp, old, old, adv, jnp.ones(4), tis_cap=None).sum())(logp)
    assert np.all(np.asarray(g[:2]) != 0) and np.all(np.asarray(g[2:]) == 0)


def test_equal_under_jit_pmap_and_mesh():
    args = _inputs(3, shape=(16, 5))
    fn = functools.partial(policy_gradient_loss, clip_eps=0.2, tis_cap=2.0)
    eager = np.asarray(fn(*args))
    np.testing.assert_allclose(jax.jit(fn)(*args), eager, rtol=1e-6)
    pm = run_pmap_rows(lambda *a, axis_name: fn(*a), *args)
    np.testing.assert_allclose(np.asarray(pm).reshape(eager.shape), eager, rtol=1e-6)
    meshed, _ = run_mesh_rows(fn, *args)
    np.testing.assert_allclose(np.asarray(meshed), eager, rtol=1e-6)

    r = np.array([1.0, 0.0, 0.5, 0.5, 1.0, 1.0, 0.0, 0.25], np.float32)
    g = np.array([0, 0, 1, 1, 2, 2, 2, 3])
    ref = np.asarray(group_advantages(r, g, normalize_std=True))
    np.testing.assert_allclose(jax.jit(group_advantages, static_argnums=2)(r, g, True), ref, rtol=1e-6)
    for out in np.asarray(run_pmap_replicated(lambda r, g: group_advantages(r, g, True), r, g)):
        np.testing.assert_allclose(out, ref, rtol=1e-6)
    meshed, _ = run_mesh_rows(lambda r, g: group_advantages(r, g, True), r, g)
    np.testing.assert_allclose(np.asarray(meshed), ref, rtol=1e-6)


def test_tied_groups_get_exactly_zero_advantage():
    """Issue 61, finding 1: a group whose rewards are equal has advantages exactly 0, also
    for rewards fp32 cannot hold exactly (0.7, 0.1, 1/3) and with normalize_std (where the
    fp32 mean's ~6e-8 residue divided by a ~6e-8 std became +-0.03..0.11, one sign a group)."""
    for value in (0.7, 0.1, 1 / 3, 0.9, 1e-3):
        for n in (2, 3, 7, 8, 16):
            r = np.full(n, value, np.float32)
            g = np.zeros(n, np.int32)
            for std in (False, True):
                a = np.asarray(group_advantages(r, g, normalize_std=std))
                assert np.all(a == 0.0), (value, n, std, a)
    # Ties beside an informative group: only the tie is zeroed, under jit too.
    r = np.array([0.7] * 8 + [0.7, 0.2, 0.2, 0.9], np.float32)
    g = np.array([0] * 8 + [1] * 4)
    for fn in (group_advantages, jax.jit(group_advantages, static_argnums=2)):
        a = np.asarray(fn(r, g, False))
        assert np.all(a[:8] == 0.0)
        np.testing.assert_allclose(a[8:], np.array([0.7, 0.2, 0.2, 0.9]) - 0.5, atol=1e-6)


def test_group_std_is_the_population_std_or_the_sample_std():
    r = np.array([1.0, 0.0, 0.0, 0.25, 0.75], np.float32)
    g = np.array([0, 0, 0, 1, 1])
    for ddof in (0, 1):
        a = np.asarray(group_advantages(r, g, normalize_std=True, std_ddof=ddof))
        for grp in (0, 1):
            x = r[g == grp].astype(np.float64)
            want = (x - x.mean()) / (x.std(ddof=ddof) + 1e-6)
            np.testing.assert_allclose(a[g == grp], want, rtol=1e-5)


# --- Trust regions (issue 61, finding 4). References written from the papers' formulas.

def _spread_inputs(seed=7, shape=(16, 12)):
    """Ratios far outside the clip range on both sides (log-ratio sd 1.5), A of both signs."""
    rng = np.random.default_rng(seed)
    logp = rng.normal(-2.0, 0.5, shape).astype(np.float32)
    prox = (logp + rng.normal(0, 1.5, shape)).astype(np.float32)
    behav = (prox + rng.normal(0, 1.0, shape)).astype(np.float32)
    adv = rng.normal(0, 1, shape).astype(np.float32)
    mask = (rng.random(shape) < 0.8).astype(np.float32)
    return logp, prox, behav, adv, mask


def _dual_clip_objective(r, adv, eps_lo, eps_hi, c):
    """Ye et al. 2020 ("Mastering complex control in MOBA games with deep RL", eq. 5):
    for A < 0 the PPO objective is bounded below by c A (c > 1):
    max(min(r A, clip(r, 1 - eps, 1 + eps) A), c A); for A >= 0 it is plain PPO."""
    ppo = np.minimum(r * adv, np.clip(r, 1 - eps_lo, 1 + eps_hi) * adv)
    return np.where(adv < 0, np.maximum(ppo, c * adv), ppo)


def _decoupled_objective(logp, prox, behav, adv, eps_lo, eps_hi, c=None):
    """Hilton et al. 2021 ("Batch size-invariance for policy optimization", decoupled PPO):
    E_behav[(pi_prox / pi_behav) min(r A, clip(r, 1 - eps, 1 + eps) A)], r = pi / pi_prox;
    with the dual clip of Ye et al. on the inner term when c is given."""
    r = np.exp(logp.astype(np.float64) - prox)
    inner = (_dual_clip_objective(r, adv, eps_lo, eps_hi, c) if c is not None
             else np.minimum(r * adv, np.clip(r, 1 - eps_lo, 1 + eps_hi) * adv))
    return np.exp(prox.astype(np.float64) - behav) * inner, r


def test_dual_clip_matches_ye_et_al_2020():
    """fp32 against a float64 numpy reference: rtol 1e-5, atol 1e-6 on the loss; the
    gradient is -w A r where the objective follows r, else exactly 0."""
    logp, prox, behav, adv, mask = _spread_inputs()
    for c, clip in ((3.0, 0.2), (2.0, (0.2, 0.28))):
        lo, hi = clip if isinstance(clip, tuple) else (clip, clip)
        obj, r = _decoupled_objective(logp, prox, behav, adv, lo, hi, c)
        want = np.where(mask > 0, -obj, 0.0)
        f = functools.partial(policy_gradient_loss, clip_eps=clip, tis_cap=float("inf"),
                              dual_clip=c)
        got = np.asarray(f(logp, prox, behav, adv, mask))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        # Where the objective follows r (neither clip binds) d obj / d logp = w A r.
        follows = np.where(adv >= 0, r * adv <= np.clip(r, 1 - lo, 1 + hi) * adv,
                           (r * adv <= np.clip(r, 1 - lo, 1 + hi) * adv) & (r * adv >= c * adv))
        w = np.exp(prox.astype(np.float64) - behav)
        g_want = np.where((mask > 0) & follows, -w * adv * r, 0.0)
        g = np.asarray(jax.grad(lambda lp: f(lp, prox, behav, adv, mask).sum())(logp))
        np.testing.assert_allclose(g, g_want, rtol=1e-5, atol=1e-6)
        dual = (adv < 0) & (r > c) & (mask > 0)
        assert dual.sum() > 0 and np.all(g[dual] == 0.0)  # the dual clip binds, no gradient
        plain = np.asarray(policy_gradient_loss(logp, prox, behav, adv, mask, clip_eps=clip,
                                                tis_cap=float("inf")))
        assert np.all(got[dual] < plain[dual])  # it bounds the loss of those tokens


def test_decoupled_ppo_matches_hilton_et_al_2021():
    """policy_gradient_loss(logp, old=pi_prox, sampler=pi_behav, tis_cap=inf) is decoupled
    PPO; tis_cap=C truncates its weight pi_prox / pi_behav at C (fp32 vs float64 numpy:
    rtol 1e-5, atol 1e-6)."""
    logp, prox, behav, adv, mask = _spread_inputs(8)
    obj, _ = _decoupled_objective(logp, prox, behav, adv, 0.2, 0.2)
    got = policy_gradient_loss(logp, prox, behav, adv, mask, clip_eps=0.2, tis_cap=float("inf"))
    np.testing.assert_allclose(got, np.where(mask > 0, -obj, 0.0), rtol=1e-5, atol=1e-6)
    w = np.exp(prox.astype(np.float64) - behav)
    capped = obj / w * np.minimum(w, 2.0)
    got = policy_gradient_loss(logp, prox, behav, adv, mask, clip_eps=0.2, tis_cap=2.0)
    np.testing.assert_allclose(got, np.where(mask > 0, -capped, 0.0), rtol=1e-5, atol=1e-6)


def test_behaviour_trust_region_bounds_a_token_already_twenty_times_likelier():
    """old = the sampler's log-probs (the proximal policy is the behaviour policy): the
    ratio is pi / pi_sampler with the correction kept. A token 20x likelier than under the
    sampler gets no gradient, whatever the sign of A (clip for A > 0, dual clip for A < 0);
    with the detached ratio (r = 1) only TIS bounds it, at weight C and still pushed."""
    samp = jnp.log(jnp.array([0.01, 0.01, 0.01, 0.01]))
    logp = jnp.log(jnp.array([0.2, 0.2, 0.0105, 0.0095]))  # ratios 20, 20, 1.05, 0.95
    adv = jnp.array([1.0, -1.0, 1.0, -1.0])
    mask = jnp.ones(4)

    def grad(old_fn, **kw):
        return np.asarray(jax.grad(lambda lp: policy_gradient_loss(
            lp, old_fn(lp), samp, adv, mask, **kw).sum())(logp))

    g = grad(lambda lp: samp, clip_eps=0.2, tis_cap=2.0, dual_clip=3.0)
    np.testing.assert_array_equal(g[:2], 0.0)
    np.testing.assert_allclose(g[2:], -np.asarray(adv[2:]) * np.array([1.05, 0.95]), rtol=1e-5)
    g = grad(jax.lax.stop_gradient, clip_eps=0.2, tis_cap=2.0)  # detached: TIS only
    np.testing.assert_allclose(g[:2], [-2.0, 2.0], rtol=1e-6)
    m = policy_gradient_metrics(logp, samp, samp, mask, adv, clip_eps=0.2, dual_clip=3.0)
    np.testing.assert_allclose([m["clip_frac"], m["dual_clip_frac"]], [0.25, 0.25])


def test_trust_region_metrics_and_bad_dual_clip():
    logp, prox, behav, adv, mask = _spread_inputs(9)
    m = policy_gradient_metrics(logp, prox, behav, mask, adv, clip_eps=0.2, dual_clip=3.0,
                                tis_cap=2.0)
    r, w, n = np.exp(logp - prox), np.exp(prox - behav), mask.sum()
    np.testing.assert_allclose(m["dual_clip_frac"], (((adv < 0) & (r > 3.0)) * mask).sum() / n,
                               rtol=1e-6)
    np.testing.assert_allclose(m["tis_frac"], ((w > 2.0) * mask).sum() / n, rtol=1e-6)
    assert set(policy_gradient_metrics(logp, prox, behav, mask, adv)) == {"clip_frac",
                                                                          "kl_to_sampler"}
    for c in (1.0, 0.5):
        with pytest.raises(ValueError, match="dual_clip"):
            policy_gradient_loss(logp, prox, behav, adv, mask, dual_clip=c)
