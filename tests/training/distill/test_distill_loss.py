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
from ac2_jax.training.distill import (DistillConfig, DistillExample, DistillLoss, SelfDistiller,
                                      divergence, pack_pairs, relevance_scores, teacher_extras,
                                      teacher_logits)

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
    from ac2_jax.training.distill.loss import _rank
    rng = np.random.default_rng(0)
    s = jnp.asarray(rng.normal(size=(2, 7, 11)) * 3, jnp.float32)
    t = jnp.asarray(rng.normal(size=(2, 7, 11)) * 3, jnp.float32)
    y = jnp.asarray(rng.integers(0, 11, size=(2, 7)), jnp.int32)
    mask = jnp.ones((2, 7), jnp.float32).at[1, 5:].set(0.0)
    for temperature in (0.5, 1.0, 2.0):
        got = _rank("sampled", 0.5, None, temperature, [s, t], {"targets": y, "mask": mask})
        want = jnp.abs(sampled_token_advantage(s, t, y, temperature=temperature)) * mask
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # and it matters here: the raw-logit ranking (what it used) is not the one at T = 0.5
    order = {T: np.argsort(-np.abs(np.asarray(sampled_token_advantage(
        s, t, y, temperature=T)))[0]).tolist() for T in (1.0, 0.5)}
    assert order[1.0] != order[0.5]
