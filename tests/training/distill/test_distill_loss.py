"""The distill loss with its teacher inside the step (ac2_jax.training.distill.loss).

The in-step teacher (dense or chunked) equals the dense reference that gathers
host-side teacher logits [R, L, V] (`teacher_logits` + `DistillLoss.__call__`),
for a live and a frozen teacher, fp32: per-token losses and metric sums rtol/atol
1e-5; param gradients (through the whole model) rtol 1e-5 with atol 1e-5 x the
leaf's largest entry. RMSD scores equal `divergence`; a chunked distiller with a
fixed teacher reports the reference loss. (The loss-level chunked/dense equality of every
kind, values and gradients at 1e-5, is tests/losses/test_chunked.py.)
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ac2_jax.losses import aggregate_loss
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.training import OptimizerConfig, create_train_state, make_train_step
from ac2_jax.training.core.objectives import StepModel, apply_loss
from ac2_jax.training.distill import (
    DistillConfig,
    DistillExample,
    DistillLoss,
    SelfDistiller,
    divergence,
    pack_pairs,
    relevance_scores,
    teacher_extras,
    teacher_logits,
)

V = 40
OPT = OptimizerConfig(learning_rate=1e-2)
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def setup():
    """A tiny model (params x3, so the hint matters) and a paired batch of 3 examples
    with different hint lengths, two sharing a row."""
    model = Decoder(DecoderConfig.tiny(vocab_size=V, num_layers=1), rngs=nnx.Rngs(2))
    g, st = create_train_state(model, OPT, rng=0)
    st = st.replace(params=jax.tree.map(lambda x: 3.0 * x, st.params))
    rng = np.random.default_rng(0)

    def ex(n_prompt, n_hint, n_resp, task):
        p = rng.integers(3, V, n_prompt).tolist()
        hint = rng.integers(3, V, n_hint).tolist()
        return DistillExample(p, p[:2] + hint + p[2:], rng.integers(3, V, n_resp).tolist(),
                              "hint", task, weight=float(rng.uniform(0.5, 2.0)))

    exs = [ex(6, 3, 5, "a"), ex(4, 5, 7, "a"), ex(8, 2, 4, "b")]
    paired = pack_pairs(exs, 32, min_rows=2)
    frozen = jax.tree.map(lambda x: x * 0.9 + 0.01, st.params)  # a different teacher
    return g, st, exs, paired, frozen


def _close(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def _close_grads(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def _value_and_grad(call, params, batch):
    """((per_token, sums), d sum(weight * per_token) / d params) of call(params)."""
    def f(p):
        per_token, sums = call(p)
        return (per_token * batch.loss_weight).sum(), (per_token, sums)
    (_, aux), grads = jax.value_and_grad(f, has_aux=True)(params)
    return aux, grads


def test_in_step_chunked_teacher_equals_host_logits(setup):
    """Live and frozen teacher: the step's chunked in-step teacher == host-side dense
    teacher logits. (The dense in-step path is the one tests/training/distill/test_distill_trainer runs.)"""
    g, st, _, paired, frozen = setup
    loss = DistillLoss(kind="jsd", beta=0.3, top_k=6, temperature=1.3)
    b, extras = paired.student, teacher_extras(paired)
    chunked = dataclasses.replace(loss, chunk_size=5)

    @jax.jit
    def run(params, frozen):
        out = {}
        for name, teacher in (("live", None), ("frozen", frozen)):
            t_logits = teacher_logits(g, params if teacher is None else teacher, st.rest,
                                      paired.teacher, paired.teacher_index)
            host = _value_and_grad(lambda p: loss(StepModel(g, p, st.rest).logits(b), b,
                                                  {"teacher_logits": t_logits}), params, b)
            step = _value_and_grad(lambda p: apply_loss(
                chunked, StepModel(g, p, st.rest, teacher), b, extras), params, b)
            out[name] = (host, step)
        return out

    out = run(st.params, frozen)
    for (want, g_want), (got, g_got) in out.values():
        assert np.abs(np.asarray(want[0])).max() > 1e-4
        _close(got, want)
        _close_grads(g_got, g_want)
    assert not np.allclose(out["live"][0][0][0], out["frozen"][0][0][0], atol=1e-4)


def test_relevance_scores_equal_the_dense_divergence(setup):
    g, st, _, paired, frozen = setup
    for teacher, loss in ((None, DistillLoss(kind="sampled")),
                          (frozen, DistillLoss(kind="forward_kl"))):
        t_params = st.params if teacher is None else teacher
        t_logits = teacher_logits(g, t_params, st.rest, paired.teacher, paired.teacher_index)
        want = divergence(g, st.params, st.rest, paired.student, t_logits, kind=loss.kind)
        assert np.abs(np.asarray(want)).max() > 1e-4
        # chunked; the dense path (chunk_size None) runs in tests/training/distill/test_distill_trainer's RMSD
        div, tmax = relevance_scores(g, st.params, teacher, st.rest, paired.student,
                                     teacher_extras(paired),
                                     dataclasses.replace(loss, chunk_size=7))
        _close(div, want)
        np.testing.assert_array_equal(tmax, jnp.argmax(t_logits, -1))


def test_chunked_distiller_with_a_fixed_teacher_takes_the_reference_step(setup):
    """OPSD with a fixed teacher and chunk_size: the step gets the frozen params as its
    `teacher`; its loss and metrics are the host-logits reference's (task_mean)."""
    g, st, exs, paired, _ = setup
    cfg = DistillConfig(teacher="fixed", rows=2, seq_len=32, groups=2, chunk_size=6)
    d = SelfDistiller(g, jax.tree.map(jnp.copy, st), cfg, OPT, donate=False)
    d.teacher_params = jax.tree.map(lambda x: 0.9 * x, d.teacher_params)
    m = d.update(exs)
    batch = pack_pairs(exs, 32, min_rows=2, min_capacity=2).student

    @jax.jit
    def reference(params, teacher):
        t_logits = teacher_logits(g, teacher, st.rest, paired.teacher, paired.teacher_index)
        per_token, sums = DistillLoss()(StepModel(g, params, st.rest).logits(batch), batch,
                                        {"teacher_logits": t_logits})
        return aggregate_loss(per_token, batch), sums

    loss, sums = reference(st.params, d.teacher_params)
    np.testing.assert_allclose(m["loss"], float(loss), **TOL)
    n = float(batch.loss_mask.sum())
    for k in ("kl", "student_logp", "teacher_logp"):
        np.testing.assert_allclose(m[k], float(sums[k]) / n, err_msg=k, **TOL)
    assert m["kl"] > 1e-4 and not _params_equal(d.state.params, st.params)


def _params_equal(a, b):
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_missing_teacher_inputs_are_named(setup):
    g, st, _, paired, _ = setup
    step = make_train_step(g, DistillLoss(), OPT, donate=False)
    with pytest.raises(ValueError, match=r"missing \['teacher_tokens'.*teacher_extras"):
        step(st, paired.student, {"teacher_index": paired.teacher_index})
    with pytest.raises(ValueError, match="teacher_logits"):
        DistillLoss()(jnp.zeros((*paired.student.shape, V)), paired.student, None)
    with pytest.raises(ValueError, match="chunk_size must be None"):
        DistillConfig(chunk_size=-1)


def test_sampled_ranking_uses_the_loss_temperature():
    """Finding 4 (issue 32): for kind="sampled" the RMSD ranking took log-probs of the
    raw logits while the loss divides them by its temperature, so the top-T positions
    were not the ones with the largest divergence of the loss."""
    from ac2_jax.losses import sampled_token_advantage
    from ac2_jax.training.distill.loss import _rank, _sampling_inputs
    rng = np.random.default_rng(0)
    s = jnp.asarray(rng.normal(size=(2, 7, 11)) * 3, jnp.float32)
    t = jnp.asarray(rng.normal(size=(2, 7, 11)) * 3, jnp.float32)
    y = jnp.asarray(rng.integers(0, 11, size=(2, 7)), jnp.int32)
    mask = jnp.ones((2, 7), jnp.float32).at[1, 5:].set(0.0)
    for temperature in (0.5, 1.0, 2.0):
        # the sampling inputs of examples that record no parameters (issue 61): the loss's
        b = pack_pairs([DistillExample([1], [2], [3] * 6, "h", "a")] * 2, 7).student
        x = {"targets": y, "mask": mask, **_sampling_inputs(b, temperature)}
        got = _rank("sampled", 0.5, None, temperature, [s, t], x)
        want = jnp.abs(sampled_token_advantage(s, t, y, temperature=temperature)) * mask
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # and it matters here: the raw-logit ranking (what it used) is not the one at T = 0.5
    order = {T: np.argsort(-np.abs(np.asarray(sampled_token_advantage(
        s, t, y, temperature=T)))[0]).tolist() for T in (1.0, 0.5)}
    assert order[1.0] != order[0.5]


# ----------------------------------------------------------------------------- finding 2

def _np_log_softmax(x):
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def _sampling_logp(logits, temperature, top_k=0):
    """log pi of the sampling distribution (logits / T, then top-k), -inf off it."""
    z = np.asarray(logits, np.float64) / temperature
    if top_k:
        z = np.where(z >= np.sort(z)[-top_k], z, -np.inf)
    return _np_log_softmax(z)


def _enumerated_batch(behaviour_logp, temperature, top_k=0):
    """One single-token example per token y the behaviour distribution can draw, weighted
    by its probability: sum(loss_weight * per_token) is then E_{y ~ behaviour}[loss(y)]."""
    exs = [DistillExample([1], [1, 2], [int(y)], "h", f"y{y}", temperature=temperature,
                          top_k=top_k, response_logprobs=[float(behaviour_logp[y])],
                          weight=float(np.exp(behaviour_logp[y])))
           for y in np.flatnonzero(np.isfinite(behaviour_logp))]
    return pack_pairs(exs, 16).student


def _expected_grad(loss, s, t, batch):
    V_ = s.shape[-1]

    @jax.jit  # one compile per call, not one per op
    def grad(sp, t, batch):
        def f(sp):
            shape = batch.tokens.shape + (V_,)
            per_token, _ = loss(jnp.broadcast_to(sp, shape), batch,
                                {"teacher_logits": jnp.broadcast_to(t, shape)})
            return (per_token * batch.loss_weight).sum()
        return jax.grad(f)(sp)
    return np.asarray(grad(jnp.asarray(s, jnp.float32), jnp.asarray(t, jnp.float32), batch),
                      np.float64)


def test_sampled_gradient_is_unbiased_at_the_recorded_sampling_parameters():
    """Finding 2 (issue 61): kind="sampled" scored every token at the loss temperature,
    so responses drawn at another temperature (or top-k, or by an older policy) gave a
    biased gradient. Enumerating the exact behaviour distribution on a 5-token vocab,
    E[grad loss] equals the exact gradient of KL(pi_s || p_t), pi_s the student's
    sampling distribution at the recorded parameters and p_t the teacher at the recorded
    temperature (fp32 vs float64: rtol 1e-4, atol 1e-6); off-policy tokens carry the
    truncated weight min(pi_s(y) / mu(y), C)."""
    rng = np.random.default_rng(0)
    s, t = rng.normal(size=5) * 1.5, rng.normal(size=5) * 1.5
    old = s + rng.normal(size=5) * 0.6  # an older student that drew off-policy examples

    def exact(T, k=0):  # d/ds KL(pi_s || p_t), pi_s at (T, top-k), p_t at T
        lp, lq = _sampling_logp(s, T, k), _sampling_logp(t, T)
        p = np.exp(lp)
        kl = np.sum(np.where(p > 0, p * (lp - lq), 0.0))
        return np.where(p > 0, p * (lp - lq - kl), 0.0) / T

    loss = DistillLoss(kind="sampled")  # loss temperature 1
    for T, k in ((0.7, 0), (1.6, 3)):  # on-policy: drawn from the current student at T (top-k)
        got = _expected_grad(loss, s, t, _enumerated_batch(_sampling_logp(s, T, k), T, k))
        np.testing.assert_allclose(got, exact(T, k), rtol=1e-4, atol=1e-6, err_msg=f"T={T} k={k}")
        assert np.abs(exact(T, k) - exact(1.0)).max() > 0.05  # the loss temperature's is another
    # off-policy: drawn by `old`; untruncated the weight makes it exact, truncated it is min(w, C)
    T, mu = 0.7, _sampling_logp(old, 0.7)
    batch = _enumerated_batch(mu, T)
    got = _expected_grad(dataclasses.replace(loss, tis_cap=None), s, t, batch)
    np.testing.assert_allclose(got, exact(T), rtol=1e-4, atol=1e-6)
    lp, lq = _sampling_logp(s, T), _sampling_logp(t, T)
    w = np.exp(lp - mu)
    assert w.max() > 1.2 and w.min() < 1.0  # the cap below binds on some tokens
    want = sum(np.exp(mu[y]) * min(w[y], 1.2) * (lp[y] - lq[y]) * (np.eye(5)[y] - np.exp(lp)) / T
               for y in range(5))
    got = _expected_grad(dataclasses.replace(loss, tis_cap=1.2), s, t, batch)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_greedy_examples_are_refused_by_the_sampled_kind(setup):
    """Finding 2 (issue 61): greedy examples (no behaviour distribution) were accepted by
    kind="sampled" without a word; the full-vocabulary kinds, exact per position, keep them."""
    g, st, exs, _, _ = setup
    greedy = [exs[0], dataclasses.replace(exs[1], temperature=0.0), exs[2]]
    cfg = DistillConfig(kind="sampled", rows=2, seq_len=32, groups=2)
    d = SelfDistiller(g, jax.tree.map(jnp.copy, st), cfg, OPT, donate=False)
    with pytest.raises(ValueError, match=r"example 1 \('a'.*sampled greedily"):
        d.update(greedy)
    d = SelfDistiller(g, jax.tree.map(jnp.copy, st), dataclasses.replace(cfg, kind="reverse_kl"),
                      OPT, donate=False)
    batch, _ = d.prepare(greedy)
    assert batch.loss_mask.sum() == sum(len(e.response) for e in exs)


def test_the_kl_metric_says_at_which_temperature_it_is_measured(setup):
    """Finding 2 (issue 61): the kl metric was KL at temperature 1 whatever the loss's;
    it is measured where the loss scores each position (the loss temperature; for
    kind="sampled" a recorded sampling temperature) and `kl_temperature` says which."""
    from ac2_jax.losses import reverse_kl
    _, _, exs, _, _ = setup
    rng = np.random.default_rng(1)
    recorded = [dataclasses.replace(e, temperature=0.7, response_logprobs=[-1.0] * len(e.response))
                for e in exs]
    for kind, examples, T_loss, T_kl in (("reverse_kl", exs, 2.0, 2.0),
                                         ("sampled", exs, 2.0, 2.0),
                                         ("sampled", recorded, 2.0, 0.7)):
        b = pack_pairs(examples, 32, min_rows=2).student
        s = jnp.asarray(rng.normal(size=b.tokens.shape + (V,)) * 2, jnp.float32)
        t = jnp.asarray(rng.normal(size=b.tokens.shape + (V,)) * 2, jnp.float32)
        loss = DistillLoss(kind=kind, temperature=T_loss)
        sums, kl = jax.jit(lambda s, t, b: (  # one compile per case, not one per op
            loss(s, b, {"teacher_logits": t})[1], reverse_kl(s, t, temperature=T_kl)))(s, t, b)
        m = np.asarray(b.loss_mask)
        want = (np.asarray(kl) * m).sum()
        np.testing.assert_allclose(sums["kl"], want, rtol=1e-5, err_msg=kind)
        np.testing.assert_allclose(sums["kl_temperature"] / m.sum(), T_kl, rtol=1e-6)


def test_sampled_kind_in_step_chunked_equals_host_logits_at_recorded_parameters(setup):
    """kind="sampled" with recorded temperatures, top-k / top-p and an older policy's
    log-probs: the step's chunked in-step teacher gives the dense host reference's
    per-token losses, metrics and gradients (fp32, as above); the importance weights
    are not all 1 and some sit at the cap."""
    g, st, exs, _, _ = setup
    rng = np.random.default_rng(3)
    params = [(0.7, 0, 1.0), (1.3, 5, 1.0), (0.9, 0, 0.8)]
    recorded = [dataclasses.replace(e, temperature=T, top_k=k, top_p=p,
                                    response_logprobs=rng.uniform(-4, -0.5, len(e.response)).tolist())
                for e, (T, k, p) in zip(exs, params)]
    paired = pack_pairs(recorded, 32, min_rows=2)
    b, extras = paired.student, teacher_extras(paired)
    loss = DistillLoss(kind="sampled", tis_cap=1.5)

    @jax.jit
    def run(params):
        t_logits = teacher_logits(g, params, st.rest, paired.teacher, paired.teacher_index)
        host = _value_and_grad(lambda p: loss(StepModel(g, p, st.rest).logits(b), b,
                                              {"teacher_logits": t_logits}), params, b)
        step = _value_and_grad(lambda p: apply_loss(dataclasses.replace(loss, chunk_size=5),
                                                    StepModel(g, p, st.rest), b, extras),
                               params, b)
        return host, step

    (want, g_want), (got, g_got) = run(st.params)
    _close(got, want)
    _close_grads(g_got, g_want)
    n = float(b.loss_mask.sum())
    assert 0 < float(want[1]["tis_capped"]) < n
    assert abs(float(want[1]["tis_weight"]) / n - 1.0) > 1e-2
    temps = np.concatenate([np.full(len(e.response), T) for e, (T, _, _) in zip(exs, params)])
    np.testing.assert_allclose(float(want[1]["kl_temperature"]), temps.sum(), rtol=1e-6)


def test_examples_without_recorded_sampling_are_counted(setup):
    """Issue 61 (review): an example that records no sampling parameters (temperature
    None) is scored by kind="sampled" at the loss temperature with weight 1, which is
    only right if the current student drew it there; the step metrics count such
    examples (`unrecorded_sampling`) so it is never silent. The full-vocabulary kinds
    score every position at the loss temperature anyway and count none."""
    g, st, exs, _, _ = setup
    recorded = dataclasses.replace(exs[1], temperature=0.8,
                                   response_logprobs=[-1.0] * len(exs[1].response))
    mixed = [exs[0], recorded, exs[2]]
    cfg = DistillConfig(kind="sampled", rows=2, seq_len=32, groups=2)
    d = SelfDistiller(g, jax.tree.map(jnp.copy, st), cfg, OPT, donate=False)
    m = d.update(mixed)
    assert m["skipped"] == 0 and m["unrecorded_sampling"] == 2
    assert m["unrecorded_sampling_tokens"] == len(exs[0].response) + len(exs[2].response)
    d = SelfDistiller(g, jax.tree.map(jnp.copy, st), dataclasses.replace(cfg, kind="reverse_kl"),
                      OPT, donate=False)
    m = d.update(mixed)
    assert m["unrecorded_sampling"] == 0 and m["unrecorded_sampling_tokens"] == 0


@pytest.mark.parametrize("cap", [0.5, 0.999, 0.0, -1.0])
def test_a_tis_cap_below_one_is_refused(cap):
    """Issue 61 (review): DistillLoss accepted a tis_cap in (0, 1), which down-weights
    on-policy tokens (weight ~1); PolicyGradientLoss refuses it, so does DistillLoss
    (and the DistillConfig that builds it)."""
    with pytest.raises(ValueError, match=r"DistillLoss.tis_cap must be None or >= 1"):
        DistillLoss(kind="sampled", tis_cap=cap)
    with pytest.raises(ValueError, match=r"tis_cap must be None or >= 1"):
        DistillConfig(kind="sampled", tis_cap=cap).loss()
    for ok in (None, 1.0, 2.0):
        DistillLoss(kind="sampled", tis_cap=ok)


def test_every_greedy_example_is_named(setup):
    """Issue 61 (review): refusing greedy examples is the one exception to "one bad trace
    never stops a run" (docs/design.md Signal rule 9): a configuration mistake, so the
    error names every greedy example, not only the first."""
    _, _, exs, _, _ = setup
    greedy = [dataclasses.replace(exs[0], temperature=0.0), exs[1],
              dataclasses.replace(exs[2], temperature=0.0)]
    with pytest.raises(ValueError, match=r"2 of 3 examples are greedy: example 0 \('a'.*"
                                         r"example 2 \('b'"):
        DistillLoss(kind="sampled").check_examples(greedy)
