"""The distill loss with its teacher inside the step (ac2_jax.training.distill.loss).

The in-step teacher (dense or chunked) equals the dense reference that gathers
host-side teacher logits [R, L, V] (`teacher_logits` + `DistillLoss.__call__`),
for a live and a frozen teacher, fp32: per-token losses and metric sums rtol/atol
1e-5; param gradients (through the whole model) rtol 1e-5 with atol 1e-5 x the
leaf's largest entry. RMSD scores equal `divergence`; a chunked distiller takes
the same update as a dense one. (The loss-level chunked/dense equality of every
kind, values and gradients at 1e-5, is tests/test_chunked.py.)
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


def test_in_step_teacher_equals_host_logits(setup):
    g, st, _, paired, frozen = setup
    loss = DistillLoss(kind="jsd", beta=0.3, top_k=6, temperature=1.3)
    b, extras = paired.student, teacher_extras(paired)
    chunked = dataclasses.replace(loss, chunk_size=5)

    @jax.jit
    def run(params, frozen):
        out = []
        for teacher in (None, frozen):  # live, frozen
            t_params = params if teacher is None else teacher
            t_logits = teacher_logits(g, t_params, st.rest, paired.teacher,
                                      paired.teacher_index)
            calls = [lambda p: loss(StepModel(g, p, st.rest).logits(b), b,  # noqa: B023
                                    {"teacher_logits": t_logits}),  # noqa: B023
                     lambda p: apply_loss(loss, StepModel(g, p, st.rest, teacher), b, extras),  # noqa: B023
                     lambda p: apply_loss(chunked, StepModel(g, p, st.rest, teacher), b,  # noqa: B023
                                          extras)]
            for call in calls:
                def f(p, call=call):
                    per_token, sums = call(p)
                    return (per_token * b.loss_weight).sum(), (per_token, sums)
                (_, aux), grads = jax.value_and_grad(f, has_aux=True)(params)
                out.append((aux, grads))
        return out

    out = run(st.params, frozen)
    for i in (0, 3):  # the host-logits reference, then the in-step teachers
        assert np.abs(np.asarray(out[i][0][0])).max() > 1e-4
        for j in (i + 1, i + 2):
            _close(out[j][0], out[i][0])
            _close_grads(out[j][1], out[i][1])
    assert not np.allclose(out[0][0][0], out[3][0][0], atol=1e-4)  # the teacher matters


def test_relevance_scores_equal_the_dense_divergence(setup):
    g, st, _, paired, frozen = setup
    for teacher, loss in ((None, DistillLoss(kind="sampled")),
                          (frozen, DistillLoss(kind="forward_kl"))):
        t_params = st.params if teacher is None else teacher
        t_logits = teacher_logits(g, t_params, st.rest, paired.teacher, paired.teacher_index)
        want = divergence(g, st.params, st.rest, paired.student, t_logits, kind=loss.kind)
        assert np.abs(np.asarray(want)).max() > 1e-4
        for chunk in (None, 7):
            div, tmax = relevance_scores(g, st.params, teacher, st.rest, paired.student,
                                         teacher_extras(paired),
                                         dataclasses.replace(loss, chunk_size=chunk))
            _close(div, want)
            np.testing.assert_array_equal(tmax, jnp.argmax(t_logits, -1))


def test_chunked_distiller_takes_the_same_update(setup):
    """OPSD with a fixed teacher: the step gets the frozen params as its `teacher`; dense
    and chunked distillers agree on loss, metrics and params; the step's loss is the
    host-logits reference with the frozen teacher."""
    g, st, exs, paired, _ = setup
    runs = {}
    for chunk in (None, 6):
        cfg = DistillConfig(teacher="fixed", rows=2, seq_len=32, groups=2, chunk_size=chunk)
        d = SelfDistiller(g, jax.tree.map(jnp.copy, st), cfg, OPT, donate=False)
        d.teacher_params = jax.tree.map(lambda x: 0.9 * x, d.teacher_params)
        runs[chunk] = (d.update(exs), d)
    (m_dense, d_dense), (m_chunk, d_chunk) = runs[None], runs[6]
    for k in ("loss", "kl", "student_logp", "teacher_logp", "grad_norm"):
        np.testing.assert_allclose(m_chunk[k], m_dense[k], err_msg=k, **TOL)
    _close_grads(d_chunk.state.params, d_dense.state.params)
    # the reference: dense host-side logits of the frozen teacher, task_mean
    loss = DistillLoss()
    t_logits = teacher_logits(g, d_dense.teacher_params, st.rest, paired.teacher,
                              paired.teacher_index)
    batch = pack_pairs(exs, 32, min_rows=2, min_capacity=2).student
    per_token, _ = loss(StepModel(g, st.params, st.rest).logits(batch), batch,
                        {"teacher_logits": t_logits})
    np.testing.assert_allclose(m_dense["loss"], float(aggregate_loss(per_token, batch)), **TOL)


def test_missing_teacher_inputs_are_named(setup):
    g, st, _, paired, _ = setup
    step = make_train_step(g, DistillLoss(), OPT, donate=False)
    with pytest.raises(ValueError, match=r"missing \['teacher_tokens'.*teacher_extras"):
        step(st, paired.student, {"teacher_index": paired.teacher_index})
    with pytest.raises(ValueError, match="teacher_logits"):
        DistillLoss()(jnp.zeros((*paired.student.shape, V)), paired.student, None)
    with pytest.raises(ValueError, match="chunk_size must be None"):
        DistillConfig(chunk_size=-1)
