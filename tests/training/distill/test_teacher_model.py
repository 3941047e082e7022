"""On-policy distillation from a teacher model (ac2_jax.training.distill.teacher).

A student and a teacher of different sizes (hidden 32 / 1 layer vs hidden 48 / 2
layers, one vocabulary): the in-step teacher model's per-token reverse KL equals a
numpy reference written from the definition, KL(p_s || p_t) = sum_v p_s(v) (log p_s(v)
- log p_t(v)) at each response position, with p_s from the student's logits and p_t
from the teacher run alone on its own prompt ++ response (no packing), fp32, rtol
1e-4 / atol 1e-5 (the two forwards differ in layout: packed rows vs one sequence);
dense and chunked alike. A distiller step with a bfloat16 teacher runs and moves
the student toward it. A vocabulary mismatch (tokenizers, or logits widths) is
refused in one line naming what differs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.training import OptimizerConfig, create_train_state
from ac2_jax.training.core.objectives import StepModel, apply_loss
from ac2_jax.training.distill import (
    DistillConfig,
    DistillExample,
    DistillLoss,
    SelfDistiller,
    TeacherModel,
    check_vocabulary,
    pack_pairs,
    teacher_extras,
)

V = 40
OPT = OptimizerConfig(learning_rate=1e-2)


def _model(seed, vocab_size=V, **kw):
    return Decoder(DecoderConfig.tiny(vocab_size=vocab_size, **kw), rngs=nnx.Rngs(seed))


def _word_tokenizer(n=V, first="[UNK]"):
    """A real `tokenizers.Tokenizer` (WordLevel) of ids 0..n-1; `first` names id 0."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {first: 0, **{f"w{i}": i for i in range(1, n)}}
    return Tokenizer(WordLevel(vocab, unk_token=first))


TOK = _word_tokenizer()


@pytest.fixture(scope="module")
def pair():
    """A 1-layer hidden-32 student, a 2-layer hidden-48 teacher (weights x3 so the
    distributions are far apart), and 3 examples: the teacher's prompt carries a hint
    in two of them, is the student's own in the third (plain OPD)."""
    student = _model(2, num_layers=1)
    teacher = _model(5, num_layers=2, hidden_size=48, intermediate_size=96, head_dim=12)
    g, p, r = nnx.split(teacher, nnx.Param, ...)
    teacher = nnx.merge(g, jax.tree.map(lambda x: 3.0 * x, p), r)
    rng = np.random.default_rng(0)

    def ex(n_prompt, n_hint, n_resp, task):
        prompt = rng.integers(3, V, n_prompt).tolist()
        hint = rng.integers(3, V, n_hint).tolist()
        return DistillExample(prompt, prompt[:2] + hint + prompt[2:],
                              rng.integers(3, V, n_resp).tolist(), "hint", task)

    exs = [ex(6, 3, 5, "a"), ex(4, 0, 7, "a"), ex(8, 2, 4, "b")]
    return student, teacher, exs


def _np_log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _logits(model, seqs):
    """fp32 logits [B, Lmax, V] of unpacked sequences, right-padded (causal: the
    padding after a sequence never reaches its positions)."""
    n = max(len(x) for x in seqs)
    tok = np.zeros((len(seqs), n), np.int32)
    seg = np.zeros((len(seqs), n), np.int32)
    for i, x in enumerate(seqs):
        tok[i, : len(x)], seg[i, : len(x)] = x, 1
    g, p, r = nnx.split(model, nnx.Param, ...)
    fwd = jax.jit(lambda p, r, t, s: nnx.merge(g, p, r)(t, jnp.arange(n)[None], s))
    return np.asarray(fwd(p, r, tok, seg))


def _reference_kl(student, teacher, exs):
    """Per example, KL(p_s || p_t) at each response position from unpacked forwards,
    over the first min(V_s, V_t) ids of both (each side renormalised there)."""
    sides = []
    for model, prompts in ((student, [e.student_prompt for e in exs]),
                           (teacher, [e.teacher_prompt for e in exs])):
        seqs = [p + e.response for p, e in zip(prompts, exs, strict=True)]
        logits = _logits(model, seqs)[..., :V]
        # position q predicts token q + 1: the response is predicted from len(prompt) - 1
        sides.append([_np_log_softmax(logits[i, len(p) - 1 : len(p) - 1 + len(e.response)])
                      for i, (p, e) in enumerate(zip(prompts, exs, strict=True))])
    return [(np.exp(ls) * (ls - lt)).sum(-1) for ls, lt in zip(*sides, strict=True)]


@pytest.fixture(scope="module")
def reference(pair):
    student, teacher, exs = pair
    return _reference_kl(student, teacher, exs)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_teacher_model_gives_the_numpy_reverse_kl(pair, reference, chunk_size):
    student, teacher, exs = pair
    g, st = create_train_state(student, OPT, rng=0)
    tm = TeacherModel.from_model(teacher, TOK)
    paired = pack_pairs(exs, 32, min_rows=2)
    loss = DistillLoss(kind="reverse_kl", chunk_size=chunk_size)
    per_token, sums = jax.jit(
        lambda p, t: apply_loss(loss, StepModel(g, p, st.rest, t), paired.student,
                                teacher_extras(paired))
    )(st.params, tm)
    want = reference
    for i, ref in enumerate(want):
        got = paired.gather_response(np.asarray(per_token), i)
        assert ref.max() > 0.05  # far apart: the check is not of two near-equal models
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5, err_msg=f"example {i}")
    np.testing.assert_allclose(float(sums["kl"]), sum(r.sum() for r in want), rtol=1e-4)


def test_a_distiller_step_with_a_bfloat16_teacher_model(pair, reference):
    """One SelfDistiller update with a bf16 teacher model: its params are bf16, the
    student moves, the metric kl is the fp32 reference's at the starting weights
    within 5% (the teacher's weights rounded to bf16), and the teacher is not in the
    checkpointed extra state."""
    student, teacher, exs = pair
    g, st = create_train_state(student, OPT, rng=0)
    tm = TeacherModel.from_model(teacher, TOK, dtype="bfloat16", name="tiny-teacher")
    assert {x.dtype for x in jax.tree.leaves(tm.params)} == {jnp.dtype(jnp.bfloat16)}
    cfg = DistillConfig(teacher="tiny-teacher", rows=2, seq_len=32, groups=2)
    d = SelfDistiller(g, jax.tree.map(jnp.copy, st), cfg, OPT, donate=False, teacher_model=tm,
                      tokenizer=TOK)
    m = d.update(exs)
    n = sum(len(r) for r in reference)
    np.testing.assert_allclose(m["kl"], sum(r.sum() for r in reference) / n, rtol=5e-2)
    moved = any(not np.array_equal(a, b) for a, b in
                zip(jax.tree.leaves(d.state.params), jax.tree.leaves(st.params), strict=True))
    assert moved and d.extra_state() is None


def test_a_teacher_model_is_required_exactly_when_named(pair):
    student, teacher, _ = pair
    g, st = create_train_state(student, OPT, rng=0)
    tm = TeacherModel.from_model(teacher, TOK)
    with pytest.raises(ValueError, match="names a teacher model; pass it loaded"):
        SelfDistiller(g, st, DistillConfig(teacher="runs/teacher"), OPT, donate=False)
    with pytest.raises(ValueError, match="teacher_model given but"):
        SelfDistiller(g, st, DistillConfig(), OPT, donate=False, teacher_model=tm)
    with pytest.raises(ValueError, match="did you mean 'fixed'"):
        DistillConfig(teacher="fixd")
    with pytest.raises(ValueError, match="method 'sft'"):
        DistillConfig(teacher="runs/teacher", method="sft")
    with pytest.raises(ValueError, match="teacher_dtype"):
        DistillConfig(teacher_dtype="bfloat16")


def test_a_vocabulary_mismatch_is_refused_by_name(pair, tmp_path):
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer

    student, _, _ = pair
    g, st = create_train_state(student, OPT, rng=0)
    small = _word_tokenizer(V - 8)
    narrow = TeacherModel.from_model(_model(1, vocab_size=V - 8), small)
    with pytest.raises(ValueError) as err:  # another tokenizer
        SelfDistiller(g, st, DistillConfig(teacher="narrow"), OPT, donate=False,
                      teacher_model=narrow, tokenizer=TOK)
    msg = str(err.value)
    assert "\n" not in msg and "distill.teacher 'narrow': vocabulary mismatch" in msg
    with pytest.raises(ValueError, match="logits width .* is below its tokenizer's 40 ids"):
        TeacherModel.from_model(_model(1, vocab_size=V - 8), TOK)
    a = build_tiny_tokenizer(str(tmp_path / "a"), vocab_size=300)
    b = build_tiny_tokenizer(str(tmp_path / "b"), vocab_size=310)
    check_vocabulary(a, a, a.vocab_size, a.vocab_size)  # the same: accepted
    check_vocabulary(a, a, a.vocab_size, a.vocab_size + 64)  # wider by padding: accepted
    with pytest.raises(ValueError, match="student's logits width .* below the tokenizer's"):
        check_vocabulary(a, a, a.vocab_size - 1, a.vocab_size)
    with pytest.raises(ValueError) as err:
        check_vocabulary(a, b, a.vocab_size, b.vocab_size, teacher_name="other")
    msg = str(err.value)
    assert "\n" not in msg and "distill.teacher 'other': vocabulary mismatch (the tokenizers " \
        "differ" in msg and "only the teacher's" in msg


def test_a_teacher_of_another_tokenizer_and_the_same_width_is_refused(pair):
    """Same logits width, another token table (one special token renamed): refused
    from the fingerprint the TeacherModel records, without check_vocabulary; and a
    teacher model without the student's tokenizer is refused."""
    student, teacher, _ = pair
    g, st = create_train_state(student, OPT, rng=0)
    other = TeacherModel.from_model(teacher, _word_tokenizer(first="<unk>"), name="other")
    with pytest.raises(ValueError) as err:
        SelfDistiller(g, st, DistillConfig(teacher="other"), OPT, donate=False,
                      teacher_model=other, tokenizer=TOK)
    assert "\n" not in str(err.value)
    assert "'other': vocabulary mismatch (the teacher's tokenizer is not" in str(err.value)
    with pytest.raises(ValueError, match="needs the student's tokenizer"):
        SelfDistiller(g, st, DistillConfig(teacher="t"), OPT, donate=False,
                      teacher_model=TeacherModel.from_model(teacher, TOK))


@pytest.fixture(scope="module")
def wide_teacher(pair):
    """The teacher with a head 8 rows wider than the tokenizer's V ids (padding rows,
    random like Qwen2.5-7B's 152064 vs its tokenizer's 151665 ids), x3 weights."""
    t = _model(5, vocab_size=V + 8, num_layers=2, hidden_size=48, intermediate_size=96,
               head_dim=12)
    g, p, r = nnx.split(t, nnx.Param, ...)
    return nnx.merge(g, jax.tree.map(lambda x: 3.0 * x, p), r)


@pytest.mark.parametrize("chunk_size", [None, 3])
def test_a_teacher_wider_by_padding_rows_gives_the_numpy_kl_over_the_common_ids(
    pair, wide_teacher, chunk_size
):
    """Student width V, teacher V + 8, one tokenizer of V ids: accepted, and the
    per-token reverse KL is the numpy reference over the first V ids of both sides
    (fp32, rtol 1e-4 / atol 1e-5); a response holding a padding id is refused."""
    student, _, exs = pair
    g, st = create_train_state(student, OPT, rng=0)
    tm = TeacherModel.from_model(wide_teacher, TOK, name="wide")
    assert tm.vocab_size == V + 8
    paired = pack_pairs(exs, 32, min_rows=2)
    loss = DistillLoss(kind="reverse_kl", chunk_size=chunk_size)
    per_token, sums = jax.jit(
        lambda p, t: apply_loss(loss, StepModel(g, p, st.rest, t), paired.student,
                                teacher_extras(paired))
    )(st.params, tm)
    want = _reference_kl(student, wide_teacher, exs)
    for i, ref in enumerate(want):
        assert ref.max() > 0.05
        np.testing.assert_allclose(paired.gather_response(np.asarray(per_token), i), ref,
                                   rtol=1e-4, atol=1e-5, err_msg=f"example {i}")
    if chunk_size is None:
        d = SelfDistiller(g, jax.tree.map(jnp.copy, st),
                          DistillConfig(teacher="wide", rows=2, seq_len=32, groups=2), OPT,
                          donate=False, teacher_model=tm, tokenizer=TOK)
        bad = dataclasses.replace(exs[0], response=[*exs[0].response[:-1], V + 3])
        with pytest.raises(ValueError, match=f"token id {V + 3}, outside the tokenizer's {V} ids"):
            d.update([bad])


def test_the_teacher_model_passes_through_a_train_step_as_a_pytree(pair):
    """Flatten / unflatten keeps the graphdef static (one compile for two teachers
    of the same shape)."""
    _, teacher, _ = pair
    tm = TeacherModel.from_model(teacher, TOK)
    leaves, tree = jax.tree.flatten(tm)
    back = jax.tree.unflatten(tree, leaves)
    assert isinstance(back, TeacherModel) and back.graphdef == tm.graphdef
    other = dataclasses.replace(tm, params=jax.tree.map(lambda x: x + 1, tm.params))
    assert jax.tree.structure(other) == tree


def test_rmsd_masking_on_top_of_a_teacher_model(pair, reference):
    """RMSD with a teacher model: the divergence it ranks is the numpy reverse KL
    (fp32, rtol 1e-4 / atol 1e-5), and it keeps at most top_t positions per response,
    those the diff judge selects (the teacher model's argmax differs there)."""
    from ac2_jax.envs import RuleJudge

    student, teacher, exs = pair
    g, st = create_train_state(student, OPT, rng=0)
    cfg = DistillConfig(method="rmsd", teacher="t", top_t=2, rows=2, seq_len=32, groups=2)
    d = SelfDistiller(g, jax.tree.map(jnp.copy, st), cfg, OPT, donate=False, tokenizer=TOK,
                      judge=RuleJudge(use_hint_keywords=False, diff=True),
                      teacher_model=TeacherModel.from_model(teacher, TOK))
    m = d.update(exs)
    rel = d.last_relevance
    for i, ref in enumerate(reference):
        np.testing.assert_allclose(rel.divergence[i], ref, rtol=1e-4, atol=1e-5)
        assert len(rel.candidates[i]) == 2 and set(rel.selected[i]) <= set(rel.candidates[i])
        resp = exs[i].response
        assert all(rel.teacher_argmax[i][p] != resp[p] for p in rel.selected[i])
    assert m["kept_tokens"] == sum(len(s) for s in rel.selected) > 0
