"""Chunked log-probs, entropies and divergences (ac2_jax.losses.chunked) equal the dense
ones: values and gradients w.r.t. hidden states and head weight, fp32, atol 1e-5 (rtol
1e-5). The compiled chunked gradient never holds one full fp32 [L, V] logits buffer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ac2_jax.losses import (
    DISTILL_KINDS,
    LMHead,
    chunked_distill_loss,
    chunked_logits_map,
    chunked_token_entropy,
    chunked_token_logprobs,
    distill_loss,
    token_entropy,
    token_logprobs,
)
from tests.support.constrained_case import constrained_case, masked_reference

B, L, D, V = 2, 9, 8, 37
TOL = dict(rtol=1e-5, atol=1e-5)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.normal(size=(B, L, D)), jnp.float32)
    w = jnp.asarray(rng.normal(0, 0.7, size=(D, V)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, (B, L)), jnp.int32)
    cot = jnp.asarray(rng.normal(size=(B, L)), jnp.float32)  # a cotangent: grads of sum(cot * f)
    return rng, h, w, targets, cot


def _close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def _sampling(rng, kind):
    if kind == "none":
        return {}
    if kind == "temperature":
        return {"temperature": 0.7}
    # per-token parameters: some positions filtered, some not, one greedy (T=0 -> 1)
    t = rng.uniform(0.5, 1.5, (B, L)).astype(np.float32)
    t[0, 0] = 0.0
    return {"temperature": jnp.asarray(t),
            "top_k": jnp.asarray(rng.choice([0, 1, 3, 50], (B, L)), jnp.int32),
            "top_p": jnp.asarray(rng.choice([1.0, 0.9, 0.3], (B, L)), jnp.float32)}


CASES = [("none", "dv", 1), ("temperature", "vd", 64), ("per_token_top_k_top_p", "dv", 4),
         ("per_token_top_k_top_p", "vd", 9)]


@pytest.mark.parametrize("sampling,layout,chunk", CASES)  # L = 9: 9 chunks ... one chunk
def test_logprobs_and_entropy_equal_dense(sampling, layout, chunk):
    rng, h, w, targets, cot = _data()
    kw = _sampling(rng, sampling)
    w = w if layout == "dv" else w.T

    def dense(h, w):
        logits = LMHead(w, layout).logits(h)
        return token_logprobs(logits, targets, **kw), token_entropy(logits)

    def chunked(h, w):
        return chunked_token_logprobs(h, LMHead(w, layout), targets, chunk_size=chunk,
                                      with_entropy=True, **kw)

    def chunked_ent(h, w):
        return chunked_token_entropy(h, LMHead(w, layout), chunk_size=chunk)

    @jax.jit
    def run(h, w):
        out = {}
        for name, f in (("dense", dense), ("chunked", chunked)):
            out[name] = (f(h, w), jax.grad(lambda h, w: (cot * f(h, w)[0]).sum(), (0, 1))(h, w))
        out["ent_grad"] = [jax.grad(lambda h, w: (cot * f(h, w)).sum(), (0, 1))(h, w)
                           for f in (lambda h, w: dense(h, w)[1], chunked_ent)]
        out["metric_grad"] = jax.grad(lambda h: chunked(h, w)[1].sum())(h)
        return out

    out = run(h, w)
    _close(out["chunked"], out["dense"])
    _close(*out["ent_grad"])  # chunked_token_entropy is differentiable
    assert not np.any(out["metric_grad"])  # the with_entropy metric is not


def test_sampling_filters_really_act():
    """The per-token top-k / top-p case differs from the raw softmax (so the test above
    compares the filtered distributions, not two copies of the unfiltered one)."""
    rng, h, w, targets, _ = _data()
    kw = _sampling(rng, "per_token_top_k_top_p")
    got = chunked_token_logprobs(h, LMHead(w), targets, chunk_size=4, **kw)
    raw = chunked_token_logprobs(h, LMHead(w), targets, chunk_size=4)
    assert np.abs(np.asarray(got - raw)).max() > 0.1


KINDS = [("reverse_kl", {}), ("forward_kl", {"temperature": 1.5, "top_k": 5}),
         ("jsd", {"beta": 0.3}), ("sampled", {"temperature": 0.8})]


@pytest.mark.parametrize("kind,kw", KINDS, ids=[f"{k}-{'-'.join(kw) or 'plain'}"
                                               for k, kw in KINDS])
def test_divergences_equal_dense(kind, kw):
    assert {k for k, _ in KINDS} == set(DISTILL_KINDS)
    rng, hs, ws, targets, cot = _data(1)
    ht = hs + jnp.asarray(rng.normal(0, 0.5, hs.shape), jnp.float32)  # the hinted context
    wt = ws + jnp.asarray(rng.normal(0, 0.1, ws.shape), jnp.float32)  # a frozen teacher's head
    mask = jnp.asarray(rng.random((B, L)) > 0.3, jnp.float32)

    def dense(hs, ws, ht, wt):
        return distill_loss(LMHead(ws).logits(hs), LMHead(wt, "dv").logits(ht), targets,
                            kind=kind, mask=mask, **kw)

    def chunked(hs, ws, ht, wt):
        return chunked_distill_loss(hs, LMHead(ws), ht, LMHead(wt), targets, kind=kind,
                                    mask=mask, chunk_size=4, **kw)

    @jax.jit
    def run(*args):
        return [(f(*args), jax.grad(lambda *a: (cot * f(*a)).sum(), (0, 1, 2, 3))(*args))
                for f in (dense, chunked)]

    (v_dense, g_dense), (v_chunked, g_chunked) = run(hs, ws, ht, wt)
    _close(v_chunked, v_dense)
    assert np.abs(np.asarray(v_dense)).max() > 1e-3
    _close(g_chunked[:2], g_dense[:2])
    for g in g_chunked[2:]:  # the teacher never gets a gradient
        assert not np.any(np.asarray(g))


def test_map_returns_any_per_token_pytree():
    rng, h, w, targets, _ = _data(2)
    def fn(logits, x):  # [B, C, V], {"t": [B, C]} -> {[B, C], [B, C]}
        z = logits[0]
        return {"argmax": jnp.argmax(z, -1),
                "picked": jnp.take_along_axis(z, x["t"][..., None], -1)[..., 0]}

    got = chunked_logits_map(fn, [(h, LMHead(w))], {"t": targets}, chunk_size=5)
    logits = LMHead(w).logits(h)
    np.testing.assert_array_equal(got["argmax"], jnp.argmax(logits, -1))
    _close(got["picked"], jnp.take_along_axis(logits, targets[..., None], -1)[..., 0])


def _temp_bytes(f, *args):
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_chunked_gradient_never_holds_full_logits():
    """Compiled temp memory (deterministic) of value_and_grad: the dense path holds at
    least one fp32 [N, V] buffer, the chunked path less than one."""
    n, d, v, chunk = 1024, 32, 4096, 64
    h = jax.ShapeDtypeStruct((1, n, d), jnp.float32)
    w = jax.ShapeDtypeStruct((d, v), jnp.float32)
    t = jnp.zeros((1, n), jnp.int32)
    full = n * v * 4
    kw = dict(temperature=0.5, top_k=3)

    def dense(h, w):
        return token_logprobs(LMHead(w).logits(h), t, **kw).sum()

    def chunked(h, w):
        return chunked_token_logprobs(h, LMHead(w), t, chunk_size=chunk, **kw).sum()

    def chunked_kl(h, w):
        return chunked_distill_loss(h, LMHead(w), h, LMHead(w), chunk_size=chunk).sum()

    grad = lambda f: jax.value_and_grad(f, (0, 1))  # noqa: E731
    assert _temp_bytes(grad(dense), h, w) >= full
    assert _temp_bytes(grad(chunked), h, w) < full / 2
    assert _temp_bytes(grad(chunked_kl), h, w) < full / 2


def test_bad_input_is_named():
    _, h, w, targets, _ = _data()
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        chunked_token_logprobs(h, LMHead(w), targets, chunk_size=0)
    with pytest.raises(ValueError, match="LMHead.layout"):
        LMHead(w, "vocab_first")
    with pytest.raises(ValueError, match=r"hidden \(2, 9, 8\) must be"):
        chunked_token_logprobs(h, LMHead(w.T, "dv"), targets, chunk_size=4)
    with pytest.raises(ValueError, match="targets"):
        chunked_token_logprobs(h, LMHead(w), targets[:, :3], chunk_size=4)
    with pytest.raises(ValueError, match="share"):
        chunked_distill_loss(h, LMHead(w), h[:, :3], LMHead(w), chunk_size=4)
    with pytest.raises(ValueError, match="vocabulary"):
        chunked_distill_loss(h, LMHead(w), h, LMHead(w[:, :5]), chunk_size=4)
    with pytest.raises(TypeError, match="LMHead"):
        chunked_logits_map(lambda z, x: z[0], [(h, w)], chunk_size=4)


def test_chunked_logprobs_equal_dense_and_keep_free_positions_bit_for_bit():
    c = constrained_case(2)
    params = dict(temperature=c["t"], top_k=c["k"], top_p=c["p"])
    masks = dict(constraint_ids=jnp.asarray(c["ids"]), constraint_masks=c["table"])
    for chunk in (5, 12):
        (lp, ent) = jax.jit(lambda h: chunked_token_logprobs(
            h, c["head"], c["targets"], chunk_size=chunk, with_entropy=True, **params, **masks))(
            c["hidden"])
        on = c["ids"] > 0
        np.testing.assert_allclose(np.asarray(lp)[on], masked_reference(c)[on], rtol=0, atol=1e-6)
        plain, ent0 = chunked_token_logprobs(c["hidden"], c["head"], c["targets"],
                                             chunk_size=chunk, with_entropy=True, **params)
        np.testing.assert_array_equal(np.asarray(lp)[~on], np.asarray(plain)[~on])
        # Entropy is the raw softmax's (a metric of the model): finite, unchanged by masks.
        np.testing.assert_array_equal(np.asarray(ent), np.asarray(ent0))



def test_under_an_fsdp_mesh_the_chunk_loop_runs_per_shard_and_equals_dense():
    """Under an 8-device fsdp mesh (`jax.set_mesh`) the chunk loop runs in shard_map
    (a head gathered once before the loop, its gradient reduced once after it):
    log-probs with per-token sampling and the entropy metric (head [16, V] split over
    fsdp), a distillation pair (a frozen teacher head; the student's in the "vd"
    layout with a width of 12, which 8 devices do not divide: replicated) and the
    gradients w.r.t. hidden states and both heads equal the dense, unsharded ones in
    fp32 (rtol = atol = 1e-5). Issue 69."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(1, 8), ("data", "fsdp"))
    rng = np.random.default_rng(3)
    r, n, d, v = 8, 11, 16, 37
    h = jnp.asarray(rng.normal(size=(r, n, d)), jnp.float32)
    w = jnp.asarray(rng.normal(0, 0.7, size=(d, v)), jnp.float32)
    h2 = jnp.asarray(rng.normal(size=(r, n, 12)), jnp.float32)
    w2 = jnp.asarray(rng.normal(0, 0.7, size=(v, 12)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, (r, n)), jnp.int32)
    cot = jnp.asarray(rng.normal(size=(r, n)), jnp.float32)
    t = jnp.asarray(rng.uniform(0.5, 1.5, (r, n)), jnp.float32)
    k = jnp.asarray(rng.integers(0, 6, (r, n)), jnp.int32)
    wt = jnp.asarray(rng.normal(0, 0.7, size=(d, v)), jnp.float32)

    def dense(h, w, h2, w2):
        z = LMHead(w).logits(h)
        logp = token_logprobs(z, targets, temperature=t, top_k=k)
        zs = LMHead(w2, "vd").logits(h2)
        kl = distill_loss(zs, LMHead(wt).logits(h * 0.5), targets, kind="reverse_kl")
        return jnp.sum(cot * logp) + jnp.sum(cot * kl), token_entropy(z)

    def chunked(h, w, h2, w2):
        logp, ent = chunked_token_logprobs(h, LMHead(w), targets, temperature=t, top_k=k,
                                           chunk_size=3, with_entropy=True)  # fmt: skip
        kl = chunked_distill_loss(h2, LMHead(w2, "vd"), h * 0.5, LMHead(wt), targets,
                                  kind="reverse_kl", chunk_size=4)  # fmt: skip
        return jnp.sum(cot * logp) + jnp.sum(cot * kl), ent

    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))  # noqa: E731
    want = grad(dense)(h, w, h2, w2)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    args = (jax.device_put(h, rows), jax.device_put(w, NamedSharding(mesh, P("fsdp"))),
            jax.device_put(h2, rows), w2)  # fmt: skip
    step = grad(chunked)
    with jax.set_mesh(mesh):
        hlo = step.lower(*args).as_text()
        got = step(*args)
    assert "shard_map" in hlo or "sdy.manual_computation" in hlo  # the per-shard path ran
    _close(got, want)
