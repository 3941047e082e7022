"""group_advantages and policy_gradient_loss: formulas, gradients, multi-device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ac2_jax.losses import group_advantages, policy_gradient_loss, policy_gradient_metrics
from tests.multidevice import run_mesh_rows, run_pmap_replicated, run_pmap_rows


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
