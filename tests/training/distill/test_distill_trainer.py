"""Self-distillation training (ac2_jax.training.distill.trainer, distill_data, distill_sources).

Equivalences are numeric in fp32: losses to 1e-5 (absolute), params to 1e-6; a resumed
run equals the uninterrupted one bitwise.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ac2_jax.envs.judges import RuleJudge
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.trace.types import Completion, Episode, Trace
from ac2_jax.training import OptimizerConfig, SFTConfig, create_train_state, publish, run_sft
from ac2_jax.training.core import read_metrics
from ac2_jax.training.core.train_step import make_train_step
from ac2_jax.training.distill.data import (
    HINT_PLACEMENTS,
    HintConfig,
    hinted_messages,
    insert_hint,
    make_example,
    pack_pairs,
)
from ac2_jax.training.distill.sources import (
    HintTask,
    PromptCache,
    SampleConfig,
    resample_examples,
    rollout_and_grade,
    sample,
)
from ac2_jax.training.distill.traces import examples_from_traces
from ac2_jax.training.distill.trainer import DistillConfig, DistillLoss, SelfDistiller
from ac2_jax.training.sft.demos import demo_segment

HINT = "Say blue."
MSGS = [{"role": "user", "content": "Pick a color."}]
OPT = OptimizerConfig(learning_rate=1e-2)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")),
                                extra_corpus=["Pick a color. red blue Say blue."] * 20)


@pytest.fixture(scope="module")
def model_state(tok):
    model = Decoder(DecoderConfig.tiny(vocab_size=tok.vocab_size, num_layers=1),
                    rngs=nnx.Rngs(3))
    return create_train_state(model, OPT, rng=0)


@pytest.fixture(scope="module")
def step_fn(model_state):
    """One compiled distill step (no donation) shared by the tests."""
    return make_train_step(model_state[0], DistillLoss(), OPT, donate=False)


def _examples(tok):
    rng = np.random.default_rng(0)
    msgs2 = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "What is 2 + 3? Answer now."}]
    return [make_example(tok, MSGS, rng.integers(10, 300, 6).tolist(), HINT, "task/a"),
            make_example(tok, msgs2, rng.integers(10, 300, 9).tolist(), "Use digits.", "task/b",
                         HintConfig(placement="after_user"))]


def _copy(state):
    return jax.tree.map(jnp.copy, state)


# ----------------------------------------------------------------------------- data


@pytest.mark.parametrize("placement", HINT_PLACEMENTS)
@pytest.mark.parametrize("system", [False, True])
def test_insert_hint_is_one_contiguous_run(tok, placement, system):
    msgs = ([{"role": "system", "content": "Be brief."}] if system else []) + MSGS
    student, teacher, (a, b) = insert_hint(tok, msgs, HINT, HintConfig(placement=placement))
    assert student == tok.apply_chat_template(msgs, tokenize=True)
    assert teacher == student[:a] + teacher[a:b] + student[a:]
    assert HINT in tok.decode(teacher[a:b])
    assert tok.decode(teacher) == tok.apply_chat_template(
        hinted_messages(msgs, HINT, HintConfig(placement=placement)))


def test_insert_hint_bad_input(tok):
    with pytest.raises(ValueError, match="placement"):
        HintConfig(placement="middle")
    with pytest.raises(ValueError, match="hint is empty"):
        insert_hint(tok, MSGS, "")
    with pytest.raises(ValueError, match="do not decode"):
        insert_hint(tok, MSGS, HINT, prompt_ids=[1, 2, 3])


def test_examples_from_traces_keep_stored_ids(tok):
    canon = tok.apply_chat_template(MSGS, tokenize=True)
    # A spliced prompt: same text, but the user content in single-character tokens.
    text = tok.apply_chat_template(MSGS)
    start = text.index("Pick")
    head = tok.encode(text[:start])
    body = [t for ch in "Pick a color." for t in tok.encode(ch)]
    tail = tok.encode(text[start + len("Pick a color."):])
    stored = head + body + tail
    assert stored != canon and tok.decode(stored) == text
    comp = Completion(prompt_ids=stored, output_ids=[5, 6, 7], output_logprobs=[-1.0] * 3,
                      messages=MSGS)
    ep = Episode("main", token_ids=stored + [5, 6, 7], loss_mask=[0] * len(stored) + [1] * 3,
                 sampler_logprobs=[0.0] * len(stored) + [-1.0] * 3, completions=[comp])
    traces = [Trace("t1", "0", episodes=[ep], hints=[HINT]), Trace("t2", episodes=[ep])]
    (ex,) = examples_from_traces(traces, tok)
    a, b = ex.hint_span
    assert ex.student_prompt == stored and ex.response == [5, 6, 7] and ex.task == "t1/0"
    assert ex.teacher_prompt == stored[:a] + ex.teacher_prompt[a:b] + stored[a:]
    assert HINT in tok.decode(ex.teacher_prompt[a:b])


def test_pack_pairs_aligns_response_positions(tok):
    exs = _examples(tok) + [make_example(tok, MSGS, [40, 41], HINT, "task/c",
                                         HintConfig(placement="system"))]
    paired = pack_pairs(exs, seq_len=96, min_rows=3)
    s, t, idx = paired.student, paired.teacher, paired.teacher_index
    assert s.shape == t.shape == idx.shape and s.shape[0] == 3
    assert len({r for r, *_ in paired.spans}) < len(exs)  # some row holds two examples
    for e, (r, c, ct, n) in zip(exs, paired.spans):
        assert n == len(e.response)
        assert s.targets[r, c:c + n].tolist() == e.response
        assert t.targets[r, idx[r, c:c + n]].tolist() == e.response
        assert idx[r, c:c + n].tolist() == list(range(ct, ct + n))
        seg = t.tokens[r][t.segment_ids[r] == t.segment_ids[r, ct]]
        assert e.hint in tok.decode(seg[:len(e.teacher_prompt)].tolist())
        assert e.hint not in tok.decode(s.tokens[r][s.segment_ids[r] == s.segment_ids[r, c]])
    assert s.loss_mask.sum() == sum(len(e.response) for e in exs)
    assert (idx[s.loss_mask == 0] == 0).all()
    short = pack_pairs(exs, seq_len=16)  # no example fits: each is cut or skipped, counted
    assert short.counts["skipped/too_long"] + short.counts["cut/too_long"] == len(exs)


# ----------------------------------------------------------------------------- losses


def _forward(g, st, ids):
    """Logits [n, V] (float64) of one unpacked sequence, right-padded to 64 for one compile
    (causal attention: the padding after it changes nothing)."""
    if g not in _JIT:
        _JIT[g] = jax.jit(lambda st, t, seg: st.model(g)(t, jnp.arange(64)[None], seg)[0])
    n = len(ids)
    tokens, seg = np.zeros((1, 64), np.int32), np.zeros((1, 64), np.int32)
    tokens[0, :n], seg[0, :n] = ids, 1
    return np.asarray(_JIT[g](st, tokens, seg), np.float64)[:n]


_JIT = {}


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _direct_rkl(model_state, exs):
    """Per example: reverse KL(student || teacher) per response token, float64, no packing."""
    g, st = model_state
    out = []
    for e in exs:
        ls, lt = (_log_softmax(_forward(g, st, prompt + e.response)[
            len(prompt) - 1:len(prompt) - 1 + len(e.response)])
            for prompt in (e.student_prompt, e.teacher_prompt))
        out.append((np.exp(ls) * (ls - lt)).sum(-1))
    return out


def test_opsd_loss_equals_direct_formula(tok, model_state, step_fn):
    exs = _examples(tok)
    d = SelfDistiller(model_state[0], _copy(model_state[1]), DistillConfig(method="opsd", rows=2),
                      OPT, step_fn=step_fn)
    m = d.update(exs)
    want = np.mean([k.mean() for k in _direct_rkl(model_state, exs)])  # task_mean
    assert m["kept_tokens"] == 15 and m["skipped"] == 0
    np.testing.assert_allclose(m["loss"], want, atol=1e-5)
    np.testing.assert_allclose(m["kl"], np.mean(np.concatenate(_direct_rkl(model_state, exs))),
                               atol=1e-5)


def test_rmsd_judge_selects_nothing_gives_zero(tok, model_state, step_fn):
    exs = _examples(tok)
    never = RuleJudge(patterns=["(?!)"], use_hint_keywords=False)
    cfg = DistillConfig(method="rmsd", top_t=3, rows=2, skip_empty=False)
    d = SelfDistiller(model_state[0], _copy(model_state[1]), cfg, OPT, judge=never,
                      tokenizer=tok, step_fn=step_fn)
    m = d.update(exs)
    assert m["kept_tokens"] == 0 and m["loss"] == 0.0 and m["grad_norm"] == 0.0
    assert d.last_relevance.candidates[0] and not any(d.last_relevance.selected)
    skip = SelfDistiller(model_state[0], _copy(model_state[1]),
                         DistillConfig(method="rmsd", top_t=3, rows=2), OPT, judge=never,
                         tokenizer=tok, step_fn=step_fn)
    assert skip.update(exs)["skipped"] == 1.0


def test_rmsd_select_all_equals_opsd_on_candidates(tok, model_state, step_fn):
    exs = _examples(tok)
    always = RuleJudge(patterns=[""], use_hint_keywords=False)
    d = SelfDistiller(model_state[0], _copy(model_state[1]),
                      DistillConfig(method="rmsd", top_t=2, rows=2), OPT, judge=always,
                      tokenizer=tok, step_fn=step_fn)
    m = d.update(exs)
    direct = _direct_rkl(model_state, exs)
    want = np.mean([np.sort(k)[-2:].mean() for k in direct])
    assert m["kept_tokens"] == 4
    np.testing.assert_allclose(m["loss"], want, atol=1e-5)
    for k, cands, sel in zip(direct, d.last_relevance.candidates, d.last_relevance.selected):
        assert sorted(cands) == sorted(np.argsort(-k)[:2].tolist()) and sel == cands


# ----------------------------------------------------------------------------- teachers


def _params_close(a, b, atol=0.0):
    return all(np.allclose(x, y, atol=atol, rtol=0) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_teacher_modes(tok, model_state, step_fn):
    exs = _examples(tok)
    g, init = model_state
    paired = pack_pairs(exs, 256, min_rows=2)
    runs = {}
    for mode in ("live", "fixed", "ema"):
        d = SelfDistiller(g, _copy(init), DistillConfig(teacher=mode, ema_decay=0.5, rows=2), OPT,
                          step_fn=step_fn)
        if mode == "live":
            before = np.asarray(d.teacher_logits(paired))  # the initial params
        for _ in range(3):
            prev = jax.device_get(d.teacher_params)
            d.update(exs)
            if mode == "ema":
                want = jax.tree.map(lambda e, p: 0.5 * e + 0.5 * np.asarray(p), prev,
                                    d.state.params)
                assert _params_close(d.teacher_params, want, atol=1e-6)
                assert not _params_close(d.teacher_params, prev)
        runs[mode] = d
        assert not _params_close(d.state.params, init.params)
    assert runs["live"].current_teacher_params() is runs["live"].state.params
    assert _params_close(runs["fixed"].teacher_params, init.params)
    np.testing.assert_array_equal(runs["fixed"].teacher_logits(paired), before)
    assert not np.allclose(runs["live"].teacher_logits(paired), before, atol=1e-4)


# ----------------------------------------------------------------------------- learning


@pytest.mark.full  # a learning run: SFT steps, a sampler, then distillation steps
def test_opsd_steps_raise_hinted_token_probability(tok, model_state, step_fn, tmp_path):
    """A model that says "red" plainly and "blue" when hinted learns "blue" from OPSD alone."""
    g, init = model_state
    hinted = hinted_messages(MSGS, HINT)
    segs = [demo_segment(tok, MSGS + [{"role": "assistant", "content": "red"}], task="plain"),
            demo_segment(tok, hinted + [{"role": "assistant", "content": "blue"}], task="hint")]
    base = run_sft(init.model(g), segs, SFTConfig(seq_len=64, batch_rows=2, steps=40), OPT).state
    base = jax.device_put(base, jax.local_devices()[0])  # placed like SelfDistiller's state
    prompts = PromptCache(tok)
    task = HintTask("pick", tuple(MSGS), hint=HINT)
    student, teacher, _ = prompts(task, HINT)
    blue = tok.encode("blue")[0]

    def p_blue(state, prompt):
        return float(jax.nn.softmax(_forward(g, state, prompt)[-1])[blue])

    assert p_blue(base, teacher) > 0.8 and p_blue(base, student) < 0.2
    greedy, pub = SampleConfig(max_new_tokens=4, temperature=0.0), str(tmp_path / "publish")
    with JaxSampler(base.model(g), publish_dir=pub, max_context=128) as sampler:
        (res,) = sample(sampler, [student], greedy, stop_token_ids=tok.stop_token_ids)
        assert tok.decode(res.output_ids).startswith("red")

        _, fresh = create_train_state(base.model(g), OPT)  # new optimizer moments
        d = SelfDistiller(g, fresh, DistillConfig(rows=2), OPT, step_fn=step_fn)
        grader = lambda t, text: None if text.startswith("blue") else HINT  # noqa: E731
        for i in range(8):
            publish(g, d.state, pub, i + 1, keep=2, sampler=sampler)  # sample from the current policy
            exs, graded = rollout_and_grade(sampler, [task], grader, prompts, greedy, seed=i)
            if not exs:
                break
            assert exs[0].student_prompt == student and exs[0].teacher_prompt == teacher
            d.update(exs)
        assert p_blue(d.state, student) > 0.5
        # resampling from the teacher context gives the hinted answer (the SFT baseline's data)
        publish(g, base, pub, 100, keep=2, sampler=sampler)
        (ex,) = resample_examples(sampler, [task], prompts, greedy, source="teacher")
    assert tok.decode(ex.response).startswith("blue")


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("teacher", ["ema", "fixed"])
def test_resume_from_a_checkpoint_equals_uninterrupted(tok, model_state, step_fn, tmp_path,
                                                       teacher):
    """4 updates straight == 2 updates, a new distiller restored from the workdir, 2 more:
    params, optimizer state and teacher params bitwise equal in fp32 (same ops, same order)."""
    exs = _examples(tok)
    batches = [exs, exs[:1], exs[1:], exs]  # update i trains on batches[i]
    g, init = model_state
    config = DistillConfig(teacher=teacher, ema_decay=0.5, rows=2)
    straight = SelfDistiller(g, _copy(init), config, OPT, step_fn=step_fn)
    for b in batches:
        straight.update(b)

    wd = tmp_path / teacher
    ckpt = dataclasses.replace(config, checkpoint_every=2)
    first = SelfDistiller(g, _copy(init), ckpt, OPT, step_fn=step_fn, workdir=wd)
    assert first.restore() == 0
    logged = [first.update(b) for b in batches[:3]]  # killed after step 3: resume from 2
    first.close()
    # A new process-like distiller: a different start state, so only the checkpoint counts.
    other = jax.tree.map(lambda x: x + 1 if x.dtype == jnp.float32 else x, _copy(init))
    resumed = SelfDistiller(g, other, ckpt, OPT, step_fn=step_fn, workdir=wd)
    assert resumed.restore() == 2
    for b in batches[2:]:
        resumed.update(b)
    resumed.close()
    assert int(resumed.state.step) == int(straight.state.step) == 4
    for a, b in zip(jax.tree.leaves(straight.state), jax.tree.leaves(resumed.state)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    for a, b in zip(jax.tree.leaves(straight.teacher_params),
                    jax.tree.leaves(resumed.teacher_params)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    rows = read_metrics(str(wd / "metrics" / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 3, 4]  # step 3 again after the resume
    assert rows[0]["train/kl"] == logged[0]["kl"] and rows[0]["train/skipped"] == 0.0
    with pytest.raises(ValueError, match="trained with .*'teacher': "):
        SelfDistiller(g, _copy(init), dataclasses.replace(ckpt, teacher="live"), OPT,
                      step_fn=step_fn, workdir=wd).restore()


def test_checkpoint_every_without_a_workdir_is_named(model_state):
    g, init = model_state
    with pytest.raises(ValueError, match="checkpoint_every=2 needs a workdir"):
        SelfDistiller(g, init, DistillConfig(checkpoint_every=2), OPT)
    with pytest.raises(ValueError, match="DistillConfig.checkpoint_every must be >= 0"):
        DistillConfig(checkpoint_every=-1)


def test_varied_opsd_batches_compile_the_step_once(tok, model_state, step_fn):
    """4 OPSD updates of 1-3 examples with responses of 3-12 tokens: one compile
    (`compiled_steps` stays 1; a count, not a timing)."""
    g, init = model_state
    d = SelfDistiller(g, _copy(init), DistillConfig(rows=2, groups=4), OPT, step_fn=step_fn)
    rng = np.random.default_rng(7)
    counts = []
    for n in (1, 3, 2, 3):
        exs = [make_example(tok, MSGS, rng.integers(10, 300, int(rng.integers(3, 13))).tolist(),
                            HINT, f"task/{n}-{i}") for i in range(n)]
        counts.append(d.update(exs)["compiled_steps"])
    d.trainer.close()
    assert counts == [1.0] * 4, counts


def test_a_too_long_example_never_stops_the_run(tok, model_state, step_fn):
    """Finding 5 (issue 61): one example longer than seq_len raised in pack_pairs and ended
    the run. The step goes on with the rest (the long response cut to fit, a prompt that
    cannot fit skipped) and the metrics count them."""
    exs = _examples(tok)
    long_resp = make_example(tok, MSGS, [50] * 300, HINT, "task/long")
    long_prompt = make_example(tok, [{"role": "user", "content": "blue " * 300}], [51, 52],
                               HINT, "task/huge")
    d = SelfDistiller(model_state[0], _copy(model_state[1]), DistillConfig(rows=2), OPT,
                      step_fn=step_fn)
    m = d.update(exs + [long_resp, long_prompt])
    assert m["skipped"] == 0 and m["skipped/too_long"] == 1 and m["cut/too_long"] == 1
    fit = 256 - len(long_resp.teacher_prompt)
    assert m["kept_tokens"] == 15 + fit
    assert m["too_long_tokens"] == (300 - fit) + 2
    # a step whose examples are all too long makes no update and says why
    m = d.update([long_prompt])
    assert m["skipped"] == 1 and m["skipped/too_long"] == 1
