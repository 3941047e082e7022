"""distill: divergences equal numpy formulas, JSD(beta) limits, top-k, temperature,
stopped teacher gradients, and equal values under jit / pmap / a sharded mesh.

Tolerances (fp32): direct formulas rtol 1e-5 / atol 1e-6; jit, pmap and mesh
against eager rtol 1e-5 / atol 1e-6; JSD(beta) limits 2% relative at beta = 1e-3.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ac2_jax.losses import (
    DISTILL_KINDS,
    distill_loss,
    forward_kl,
    generalized_jsd,
    reverse_kl,
    sampled_token_advantage,
    sampled_token_loss,
)

R, L, V = 8, 5, 11
TOL = dict(rtol=1e-5, atol=1e-6)


def _inputs(seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    s = (rng.normal(size=(R, L, V)) * scale).astype(np.float32)
    t = (rng.normal(size=(R, L, V)) * scale).astype(np.float32)
    y = rng.integers(0, V, size=(R, L)).astype(np.int32)
    mask = (rng.random((R, L)) < 0.7).astype(np.float32)
    return s, t, y, mask


def _np_logp(x):
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _np_kl(lp, lq):
    return (np.exp(lp) * (lp - lq)).sum(-1)


def _np_jsd(ls, lt, beta):
    m = beta * np.exp(lt) + (1 - beta) * np.exp(ls)
    return beta * _np_kl(lt, np.log(m)) + (1 - beta) * _np_kl(ls, np.log(m))


def _np_topk(s, t, k):
    idx = np.argsort(-t, axis=-1, kind="stable")[..., :k]
    return np.take_along_axis(s, idx, -1), np.take_along_axis(t, idx, -1)


def test_divergences_equal_numpy_formulas():
    s, t, y, _ = _inputs()
    ls, lt = _np_logp(s), _np_logp(t)
    np.testing.assert_allclose(reverse_kl(s, t), _np_kl(ls, lt), **TOL)
    np.testing.assert_allclose(forward_kl(s, t), _np_kl(lt, ls), **TOL)
    for beta in (0.1, 0.5, 0.9):
        np.testing.assert_allclose(generalized_jsd(s, t, beta=beta), _np_jsd(ls, lt, beta), **TOL)
    pick = lambda lp: np.take_along_axis(lp, y[..., None], -1)[..., 0]  # noqa: E731
    adv = pick(lt) - pick(ls)
    np.testing.assert_allclose(sampled_token_advantage(s, t, y), adv, **TOL)
    np.testing.assert_allclose(sampled_token_loss(s, t, y), -adv * pick(ls), **TOL)
    # beta = 0.5 is the symmetric JSD: swapping student and teacher gives the same value.
    np.testing.assert_allclose(generalized_jsd(s, t, beta=0.5), generalized_jsd(t, s, beta=0.5), **TOL)


@pytest.mark.parametrize("kind", ["reverse_kl", "forward_kl", "jsd"])
def test_nonnegative_and_zero_on_equal_logits(kind):
    s, t, y, _ = _inputs(1, scale=3.0)
    assert float(jnp.min(distill_loss(s, t, y, kind=kind))) >= 0.0
    assert float(jnp.min(distill_loss(s, t, y, kind=kind))) > 0.0  # distinct logits
    # Equal distributions (logits differ by a per-position constant) -> 0.
    same = distill_loss(s, s + 2.5, y, kind=kind)
    np.testing.assert_allclose(same, 0.0, atol=1e-6)


def test_sampled_advantage_zero_on_equal_logits():
    s, _, y, _ = _inputs(2)
    np.testing.assert_allclose(sampled_token_advantage(s, s - 1.0, y), 0.0, atol=1e-6)
    np.testing.assert_allclose(distill_loss(s, s, y, kind="sampled"), 0.0, atol=1e-6)


def test_jsd_beta_limits_are_scaled_kls():
    s, t, _, _ = _inputs(3)
    fwd, rev = np.asarray(forward_kl(s, t)), np.asarray(reverse_kl(s, t))
    errs_fwd, errs_rev = [], []
    for b in (1e-1, 1e-2, 1e-3):
        errs_fwd.append(np.max(np.abs(generalized_jsd(s, t, beta=b) / b - fwd) / fwd))
        errs_rev.append(np.max(np.abs(generalized_jsd(s, t, beta=1 - b) / b - rev) / rev))
    # beta -> 0: JSD/beta -> KL(teacher||student); beta -> 1: JSD/(1-beta) -> KL(student||teacher).
    assert errs_fwd[-1] < 2e-2 and errs_rev[-1] < 2e-2, (errs_fwd, errs_rev)
    assert errs_fwd[0] > errs_fwd[1] > errs_fwd[2]
    assert errs_rev[0] > errs_rev[1] > errs_rev[2]
    # ... and not the other way round (the KLs differ on these inputs).
    assert np.max(np.abs(generalized_jsd(s, t, beta=1e-3) / 1e-3 - rev) / rev) > 0.1
    for bad in (0.0, 1.0, -0.2, 1.5):
        with pytest.raises(ValueError, match="beta"):
            generalized_jsd(s, t, beta=bad)


def test_top_k_restricts_to_teacher_top_k_renormalized():
    s, t, _, _ = _inputs(4, scale=2.0)
    for k in (1, 3, 6):
        sk, tk = _np_topk(s, t, k)
        lsk, ltk = _np_logp(sk), _np_logp(tk)
        np.testing.assert_allclose(reverse_kl(s, t, top_k=k), _np_kl(lsk, ltk), **TOL)
        np.testing.assert_allclose(forward_kl(s, t, top_k=k), _np_kl(ltk, lsk), **TOL)
        np.testing.assert_allclose(generalized_jsd(s, t, beta=0.3, top_k=k),
                                   _np_jsd(lsk, ltk, 0.3), **TOL)
    np.testing.assert_allclose(reverse_kl(s, t, top_k=1), 0.0, atol=1e-6)  # one token: no divergence
    np.testing.assert_allclose(reverse_kl(s, t, top_k=V), reverse_kl(s, t), **TOL)
    np.testing.assert_allclose(reverse_kl(s, t, top_k=10 * V), reverse_kl(s, t), **TOL)
    # The restriction follows the teacher: student-only mass outside is ignored.
    s2 = s.copy()
    _, idx = jax.lax.top_k(t, 3)
    outside = np.ones((R, L, V), bool)
    np.put_along_axis(outside, np.asarray(idx), False, -1)
    s2[outside] += 50.0
    np.testing.assert_allclose(reverse_kl(s2, t, top_k=3), reverse_kl(s, t, top_k=3), **TOL)
    with pytest.raises(ValueError, match="top_k"):
        reverse_kl(s, t, top_k=0)


def test_temperature_divides_both_logits():
    s, t, y, _ = _inputs(5)
    for kind in DISTILL_KINDS:
        np.testing.assert_allclose(distill_loss(s, t, y, kind=kind, temperature=2.0),
                                   distill_loss(s / 2.0, t / 2.0, y, kind=kind), **TOL)
    ls, lt = _np_logp(s / 0.5), _np_logp(t / 0.5)
    np.testing.assert_allclose(reverse_kl(s, t, temperature=0.5), _np_kl(ls, lt), **TOL)
    # Higher temperature flattens both distributions: divergence shrinks towards 0.
    vals = [float(reverse_kl(s, t, temperature=T).mean()) for T in (1.0, 4.0, 64.0)]
    assert vals[0] > vals[1] > vals[2] and vals[2] < 1e-3
    with pytest.raises(ValueError, match="temperature"):
        reverse_kl(s, t, temperature=0.0)


@pytest.mark.parametrize("kind", DISTILL_KINDS)
def test_teacher_gradient_is_stopped(kind):
    s, t, y, m = _inputs(6)
    g_t = jax.grad(lambda tt: distill_loss(s, tt, y, kind=kind, mask=m).sum())(t)
    assert float(jnp.abs(g_t).max()) == 0.0
    g_s = jax.grad(lambda ss: distill_loss(ss, t, y, kind=kind, mask=m).sum())(s)
    assert float(jnp.abs(g_s).max()) > 0.0


def test_reverse_kl_gradient_vanishes_on_a_saturated_student_forward_kl_does_not():
    """Why the faithful pinapple base (trained to a loss of ~0.002) did not move under
    reverse KL (docs/notes/2026-12-06-rmsd-vs-opsd-faithful-analysis-judge-try4.md): with the student sure of one token by a logit gap
    g and the teacher sure of another, d KL(s||t) / d logits falls like exp(-g), while
    d KL(t||s) / d logits = softmax(s) - softmax(t) stays ~1."""
    teacher = jnp.zeros((1, V)).at[0, 1].set(12.0)
    for gap, rev_bound in ((5.0, 0.5), (10.0, 1e-2), (20.0, 1e-6)):
        student = jnp.zeros((1, V)).at[0, 0].set(gap)
        g_rev = jax.grad(lambda x: reverse_kl(x, teacher).sum())(student)
        g_fwd = jax.grad(lambda x: forward_kl(x, teacher).sum())(student)
        assert float(jnp.abs(g_rev).max()) < rev_bound
        assert float(jnp.abs(g_fwd).max()) > 0.99


def test_sampled_loss_is_unbiased_reverse_kl_gradient():
    # E_{y ~ p_s}[grad(-stop(adv_y) log p_s(y))] == grad KL(student || teacher), exactly.
    s, t, _, _ = _inputs(7)
    s1, t1 = s[0, 0], t[0, 0]  # one position, [V]
    p_s = np.exp(_np_logp(s1))

    def expected(ss):
        ys = jnp.arange(V, dtype=jnp.int32)
        losses = sampled_token_loss(jnp.broadcast_to(ss, (V, V)), jnp.broadcast_to(t1, (V, V)), ys)
        return jnp.sum(jnp.asarray(p_s, jnp.float32) * losses)

    g_pg = jax.grad(expected)(s1)
    g_kl = jax.grad(lambda ss: reverse_kl(ss[None], t1[None])[0])(s1)
    np.testing.assert_allclose(g_pg, g_kl, rtol=1e-4, atol=1e-6)


def test_sampled_loss_at_per_token_sampling_parameters_with_importance_weights():
    """Per-position temperature / top-k / top-p (issue 61): the student is scored under
    its sampling distribution, the teacher at the same temperature over the whole
    vocabulary, and w = min(exp(log pi_s(y) - sampler_logprobs), cap) where `recorded`,
    1 elsewhere; numpy formulas at rtol 1e-5 / atol 1e-6."""
    s, t, y, _ = _inputs(11, scale=2.0)
    rng = np.random.default_rng(11)
    T = rng.uniform(0.5, 1.5, (R, L)).astype(np.float32)
    k = rng.choice([0, 3], (R, L)).astype(np.int32)
    y = np.where(k > 0, np.argsort(-s, -1)[..., 0], y).astype(np.int32)  # a token top-3 keeps
    mu = rng.uniform(-3, -0.5, (R, L)).astype(np.float32)
    rec = (rng.random((R, L)) < 0.6).astype(np.float32)
    loss, w = sampled_token_loss(s, t, y, temperature=T, top_k=k, sampler_logprobs=mu,
                                 recorded=rec, tis_cap=1.5, return_weights=True)
    z = s.astype(np.float64) / T[..., None]
    kth = np.sort(z, -1)[..., -3][..., None]
    lp_s = np.take_along_axis(_np_logp(np.where((k[..., None] == 0) | (z >= kth), z, -np.inf)),
                              y[..., None], -1)[..., 0]
    lp_t = np.take_along_axis(_np_logp(t / T[..., None]), y[..., None], -1)[..., 0]
    want_w = np.where(rec > 0, np.minimum(np.exp(lp_s - mu), 1.5), 1.0)
    np.testing.assert_allclose(w, want_w, **TOL)
    np.testing.assert_allclose(loss, -want_w * (lp_t - lp_s) * lp_s, **TOL)
    assert 0 < (want_w == 1.5).sum() and (want_w < 1).any()
    np.testing.assert_allclose(sampled_token_advantage(s, t, y, temperature=T, top_k=k),
                               lp_t - lp_s, **TOL)


def test_mask_and_bad_inputs():
    s, t, y, m = _inputs(8)
    out = distill_loss(s, t, y, mask=m)
    np.testing.assert_allclose(out, np.where(m > 0, reverse_kl(s, t), 0.0), **TOL)
    with pytest.raises(ValueError, match="kind"):
        distill_loss(s, t, y, kind="tv")
    with pytest.raises(ValueError, match="same"):
        distill_loss(s, t[..., :-1], y)
    with pytest.raises(ValueError, match="targets"):
        distill_loss(s, t, y[:, :-1])
    with pytest.raises(ValueError, match="needs targets"):
        distill_loss(s, t, None, kind="sampled")
    with pytest.raises(ValueError, match="top_k"):
        distill_loss(s, t, y, kind="sampled", top_k=3)


def _all_kinds(s, t, y, m):
    return jnp.stack([distill_loss(s, t, y, kind="reverse_kl", mask=m),
                      distill_loss(s, t, y, kind="forward_kl", mask=m, top_k=4),
                      distill_loss(s, t, y, kind="jsd", beta=0.3, mask=m, temperature=1.5),
                      distill_loss(s, t, y, kind="sampled", mask=m)])


def test_equal_under_jit_pmap_and_sharded_mesh():
    s, t, y, m = _inputs(9)
    eager = np.asarray(_all_kinds(s, t, y, m))  # [4, R, L]
    np.testing.assert_allclose(jax.jit(_all_kinds)(s, t, y, m), eager, **TOL)

    devs = jax.devices()[:8]
    assert len(devs) == 8, "tests/conftest.py forces 8 host devices"
    split = lambda x: x.reshape((8, R // 8) + x.shape[1:])  # noqa: E731
    out = jax.pmap(_all_kinds, devices=devs)(split(s), split(t), split(y), split(m))  # [8, 4, R/8, L]
    np.testing.assert_allclose(np.moveaxis(np.asarray(out), 0, 1).reshape(eager.shape), eager, **TOL)

    mesh = Mesh(np.array(devs), ("data",))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", *([None] * (x.ndim - 1)))))  # noqa: E731
    args = [put(x) for x in (s, t, y, m)]
    assert len(args[0].sharding.device_set) == 8
    np.testing.assert_allclose(jax.jit(_all_kinds)(*args), eager, **TOL)
