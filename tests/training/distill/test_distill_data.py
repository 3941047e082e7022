"""distill_data: examples from every completion of a trace, agent filters, per-agent
hint placement, merged append-only episodes, and example weights that scale the loss.

The trace is built as the endpoint builds one (real tiny tokenizer, `build_prompt_ids`
with spliced turns and tool schemas, `TraceRecorder`): a main agent that calls tools,
a compactor, main again after compaction, and a subagent.

Tolerances (fp32): losses 1e-5 absolute; weight scaling: loss rtol 1e-5, every gradient
leaf rtol 1e-5 with atol 1e-5 x the leaf's largest entry (fp32 rounding of the backward
sums; a weight that cancelled out would be off by |w - 1| x the gradient).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from ac2_jax.losses import candidate_mask, relevance_mask
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.segments import SAMPLER_LOGPROBS, Segment, pack_segments
from ac2_jax.serving.core.splice import TurnMemory, build_prompt_ids
from ac2_jax.text import parse_tool_calls
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.trace.recorder import TraceRecorder
from ac2_jax.trace.types import Completion, Trace
from ac2_jax.training import OptimizerConfig, create_train_state
from ac2_jax.training.core.train_step import make_train_step
from ac2_jax.training.distill.data import (
    LOGPROBS_RECORDED,
    SAMPLING_RECORDED,
    DistillExample,
    HintConfig,
    insert_hint,
    make_example,
    pack_pairs,
)
from ac2_jax.training.distill.loss import relevance_scores, teacher_extras
from ac2_jax.training.distill.traces import examples_from_traces
from ac2_jax.training.distill.trainer import (
    DistillConfig,
    DistillLoss,
    SelfDistiller,
    divergence,
    rmsd_candidates,
)
from tests.support.serving_helpers import SYSTEM, TOOLS, TURNS, USER

HINT = "Add all three numbers before answering."
AGENTS = ("main", "compactor", "subagent:helper")
SEQ = 768
OPT = OptimizerConfig(learning_rate=1e-2)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")),
                                extra_corpus=[HINT, "Summarize the work so far."] * 20)


@pytest.fixture(scope="module")
def model_state(tok):
    """A fresh tiny model is near-uniform (KL ~1e-5); params x3 make the hint matter."""
    model = Decoder(DecoderConfig.tiny(vocab_size=tok.vocab_size), rngs=nnx.Rngs(5))
    g, st = create_train_state(model, OPT, rng=0)
    return g, st.replace(params=jax.tree.map(lambda x: 3.0 * x, st.params))


@pytest.fixture(scope="module")
def step_fn(model_state):
    return make_train_step(model_state[0], DistillLoss(), OPT, donate=False)


def _agent_trace(tok) -> Trace:
    """main (2 tool turns) | compactor | main after compaction (2 turns) | subagent:helper (2)."""
    trace = Trace("add", attempt_id="0", hints=[HINT], status="finished")
    rec, memory = TraceRecorder(trace), TurnMemory()
    lp = iter(np.linspace(-0.1, -2.0, 500).tolist())

    def turn(agent, messages, tools, text, result=None):
        prompt, _ = build_prompt_ids(tok, messages, tools, memory)
        out = tok.encode(text) + [tok.eos_token_id]
        rec.record(agent, Completion(prompt, out, [next(lp) for _ in out],
                                     messages=[dict(m) for m in messages]))
        content, calls = parse_tool_calls(text)
        memory.remember(content, calls, out)
        messages = messages + [{"role": "assistant", "content": content or None,
                                "tool_calls": calls or None}]
        return messages + [{"role": "tool", "tool_call_id": c["id"], "content": result}
                           for c in calls]

    m = turn("main", [SYSTEM, USER], TOOLS, TURNS[0][0], TURNS[0][1])
    turn("main", m, TOOLS, TURNS[1][0], TURNS[1][1])
    turn("compactor", [{"role": "system", "content": "Summarize the work so far."},
                       {"role": "user", "content": "The agent added 3 and 4 and got 7."}], None,
         "Added 3 and 4: 7.")
    m = turn("main", [SYSTEM, {"role": "user", "content": USER["content"] + " Memo: 3 + 4 = 7."}],
             TOOLS, TURNS[1][0], TURNS[1][1])
    turn("main", m, TOOLS, TURNS[2][0])
    s = turn("subagent:helper", [SYSTEM, USER], TOOLS, TURNS[0][0], TURNS[0][1])
    turn("subagent:helper", s, TOOLS, TURNS[1][0], TURNS[1][1])
    assert [e.agent for e in trace.episodes] == ["main", "compactor", "main", "subagent:helper"]
    return trace


@pytest.fixture(scope="module")
def trace(tok):
    return _agent_trace(tok)


def _output_tokens(trace, agent=None):
    return sum(len(c.output_ids) for e in trace.episodes if agent in (None, e.agent)
               for c in e.completions)


def _per_token_opsd(model_state, paired):
    """The OPSD per-position loss (reverse KL) at the initial params [R, L]."""
    g, st = model_state
    d = SelfDistiller(g, jax.tree.map(jnp.copy, st), DistillConfig(seq_len=SEQ), OPT)
    return np.asarray(divergence(g, d.state.params, d.state.rest, paired.student,
                                 d.teacher_logits(paired)))


# ----------------------------------------------------------------------------- every completion


def test_opsd_trains_main_compactor_and_subagent_tokens(tok, model_state, step_fn, trace):
    exs = examples_from_traces([trace], tok)
    assert {e.agent for e in exs} == set(AGENTS)
    assert {e.task for e in exs} == {"add/0"}  # one task: one group in task_mean
    paired = pack_pairs(exs, SEQ)
    s = paired.student
    # every agent token of the trace is trained exactly once (loss_mask counts)
    assert s.loss_mask.sum() == trace.num_agent_tokens == _output_tokens(trace)
    per_token = _per_token_opsd(model_state, paired)
    for agent in AGENTS:
        idx = [i for i, e in enumerate(exs) if e.agent == agent]
        mask = np.concatenate([paired.gather_response(s.loss_mask, i) for i in idx])
        loss = np.concatenate([paired.gather_response(per_token, i) for i in idx])
        assert mask.sum() == _output_tokens(trace, agent)
        assert (loss[mask > 0] > 1e-3).all(), agent
    # every response token is the completion's own output, taught with its own prompt + hint
    requests = [(c.prompt_ids, c.output_ids) for ep in trace.episodes for c in ep.completions]
    assert [(e.student_prompt, e.response) for e in exs] == requests  # before_turn: per request
    for e in exs:
        a, b = e.hint_span
        assert HINT in tok.decode(e.teacher_prompt[a:b])
        assert e.teacher_prompt[:a] + e.teacher_prompt[b:] == e.student_prompt
    d = SelfDistiller(model_state[0], jax.tree.map(jnp.copy, model_state[1]),
                      DistillConfig(seq_len=SEQ), OPT, step_fn=step_fn)
    m = d.update(exs)
    assert m["kept_tokens"] == trace.num_agent_tokens and m["skipped"] == 0
    want = (per_token * s.loss_mask).sum() / s.loss_mask.sum()  # one task: token mean
    np.testing.assert_allclose(m["loss"], want, atol=1e-5)


def test_agent_filter(tok, trace):
    def agents(**kw):
        return [e.agent for e in examples_from_traces([trace], tok, **kw)]

    assert agents(agents="main") == ["main"] * 4  # both main episodes, every request
    assert agents(agents=("subagent:*",)) == ["subagent:helper"] * 2  # every subagent
    assert agents(agents="subagent:helper") == ["subagent:helper"] * 2
    assert agents(agents=("compactor", "subagent:*")) == ["compactor"] + ["subagent:helper"] * 2
    assert agents(agents="subagent:other") == [] and agents(agents="mai") == []
    for bad in ("subagent", "subagent:", "sub*"):  # one pattern language (trace.agents)
        with pytest.raises(ValueError, match="examples_from_traces: agents"):
            agents(agents=bad)
    assert sorted(agents()) == sorted(agents(agents=AGENTS))
    counts = {}
    examples_from_traces([trace, Trace("nohint", episodes=trace.episodes)], tok,
                         agents="main", counts=counts)
    assert counts["traces_without_hints"] == 1 and counts["examples"] == 4


def test_hint_config_per_agent(tok, trace):
    cfg = {"main": HintConfig(placement="system"), "compactor": HintConfig(placement="after_user"),
           "subagent:*": HintConfig(placement="before_turn", role="user")}
    exs = examples_from_traces([trace], tok, config=cfg, merge=False)
    assert sorted({e.agent for e in exs}) == sorted(AGENTS)
    for e in exs:
        a, b = e.hint_span
        before, hint = tok.decode(e.teacher_prompt[:a]), tok.decode(e.teacher_prompt[a:b])
        after = tok.decode(e.teacher_prompt[b:])
        assert HINT in hint
        if e.agent == "main":  # inside the first system message
            assert "<|im_end|>" not in before and before.endswith(SYSTEM["content"])
        elif e.agent == "compactor":  # appended to the last user message
            assert before.endswith("got 7.") and after.startswith("<|im_end|>")
        else:  # a new user message right before the response
            assert hint.startswith("<|im_start|>user") and after == "<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="compactor"):
        examples_from_traces([trace], tok, config={"main": HintConfig()})


def test_merged_episodes_equal_per_request_examples(tok, model_state, trace):
    """With the hint in the system message, each append-only episode is one example (mask 1
    on each output span) and gives the per-request examples' per-token losses."""
    cfg = HintConfig(placement="system")
    merged = examples_from_traces([trace], tok, config=cfg)
    single = examples_from_traces([trace], tok, config=cfg, merge=False)
    assert [e.agent for e in merged] == ["main", "compactor", "main", "subagent:helper"]
    assert len(single) == 7
    for e, ep in zip(merged, trace.episodes):
        mask = np.asarray(e.response_mask if e.response_mask is not None else [1] * len(e.response))
        assert e.student_prompt + e.response == ep.token_ids
        assert mask.tolist() == ep.loss_mask[len(e.student_prompt):]
        lps = np.asarray(e.response_logprobs)
        np.testing.assert_array_equal(lps, ep.sampler_logprobs[len(e.student_prompt):])
    pm, ps = pack_pairs(merged, SEQ), pack_pairs(single, SEQ)
    lm, ls = _per_token_opsd(model_state, pm), _per_token_opsd(model_state, ps)
    assert pm.student.loss_mask.sum() == ps.student.loss_mask.sum() == trace.num_agent_tokens


    def trained(paired, per_token):  # per-token losses of the trained tokens, in trace order
        return np.concatenate([paired.gather_response(per_token, i)[e.trained_mask() > 0]
                               for i, e in enumerate(paired.examples)])

    np.testing.assert_allclose(trained(pm, lm), trained(ps, ls), atol=1e-5)
    assert trained(pm, lm).min() > 1e-3
    assert (pm.teacher_index[pm.student.loss_mask == 0] == 0).all()
    # tool results inside a merged response are context (mask 0), not trained
    assert all(0 in e.response_mask for e in merged if e.agent != "compactor")


class _SelectAll:
    """A judge that selects every candidate (RMSD then keeps exactly the top-T)."""

    def select(self, example):
        return list(example.candidates)


def test_rmsd_keeps_the_same_positions_merged_and_split(tok, model_state, trace):
    """Finding 3 (issue 61): RMSD's top-T budget was per packed segment, so a merged
    episode (one example) kept T positions where the same turns split kept T per
    request. The budget is per model response: both layouts keep the same tokens."""
    g, st = model_state
    cfg = HintConfig(placement="system")
    merged = examples_from_traces([trace], tok, config=cfg)
    single = examples_from_traces([trace], tok, config=cfg, merge=False)
    assert len(merged) < len(single) == 7
    d = SelfDistiller(g, jax.tree.map(jnp.copy, st), DistillConfig(method="rmsd", top_t=4,
                      seq_len=SEQ), OPT, judge=_SelectAll(), tokenizer=tok)

    # Both layouts in the same number of rows: the second pass runs the first's programs.
    rows = max(pack_pairs(x, SEQ).student.shape[0] for x in (merged, single))

    def kept_in_trace_order(examples):
        paired = pack_pairs(examples, SEQ, min_rows=rows)
        kept, _ = d.relevance(paired)
        return np.concatenate([paired.gather_response(kept, i)[e.trained_mask() > 0]
                               for i, e in enumerate(paired.examples)])

    km, ks = kept_in_trace_order(merged), kept_in_trace_order(single)
    assert len(km) == len(ks) == trace.num_agent_tokens
    assert (ks > 0).sum() == sum(min(4, len(c.output_ids)) for e in trace.episodes
                                 for c in e.completions)
    np.testing.assert_array_equal(km > 0, ks > 0)

    # The trainer's selection (`rmsd_candidates`, one jitted program) equals the eager
    # library functions `candidate_mask` / `relevance_mask` exactly (fp32 masks).
    paired = pack_pairs(single, SEQ, min_rows=rows)
    kept, _ = d.relevance(paired)
    div, _ = relevance_scores(g, d.state.params, d.teacher_params, d.state.rest,
                              paired.student, teacher_extras(paired), d.config.loss())
    mask, groups = jnp.asarray(paired.student.loss_mask), jnp.asarray(paired.response_ids)
    cand = np.asarray(candidate_mask(div, mask, 4, None, groups))  # eager
    assert cand.dtype == np.float32 and (cand > 0).sum() == (ks > 0).sum()
    np.testing.assert_array_equal(np.asarray(rmsd_candidates(div, mask, 4, None, groups)), cand)
    eager_kept = np.asarray(relevance_mask(div, mask, jnp.asarray(cand > 0, jnp.float32), 4, None,
                                           groups))
    assert kept.dtype == eager_kept.dtype == np.float32
    np.testing.assert_array_equal(kept, eager_kept)


def test_insert_hint_into_stored_prompt_with_tools(tok, trace):
    """Recorded prompts carry tool schemas that `messages` alone do not render; the hint
    still enters as one run at a token boundary of the stored ids."""
    c = trace.episodes[0].completions[1]
    assert tok.decode(c.prompt_ids) != tok.apply_chat_template(c.messages,
                                                               add_generation_prompt=True)
    for placement in ("system", "after_user", "before_turn"):
        ids, teacher, (a, b) = insert_hint(tok, c.messages, HINT, HintConfig(placement=placement),
                                           c.prompt_ids)
        assert ids == c.prompt_ids and teacher == ids[:a] + teacher[a:b] + ids[a:]
        assert HINT in tok.decode(teacher[a:b])
    with pytest.raises(ValueError, match="do not decode"):
        insert_hint(tok, c.messages, HINT, HintConfig(placement="system"), [1, 2, 3])


# ----------------------------------------------------------------------------- weights


def _grad_capture():
    """An optax transform whose state is the last gradient (params stay put)."""
    return optax.GradientTransformation(
        lambda p: jax.tree.map(jnp.zeros_like, p),
        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


def test_example_weight_scales_loss_and_gradient(tok, model_state):
    msgs = [{"role": "user", "content": "What is 3 + 4?"}]
    g, st = model_state
    opt = _grad_capture()
    step = make_train_step(g, DistillLoss(), opt, donate=False)
    out = {}
    for w in (1.0, 2.5, 0.25):
        ex = make_example(tok, msgs, tok.encode("It is 7.") + [tok.eos_token_id], HINT, "t",
                          weight=w)
        paired = pack_pairs([ex], 64)
        r, c, _, n = paired.spans[0]
        assert paired.student.loss_mask[r, c:c + n].tolist() == [1.0] * n  # a count
        assert paired.student.loss_weight[r, c:c + n].tolist() == [w] * n
        _, fresh = create_train_state(nnx.merge(g, st.params, st.rest), opt)
        d = SelfDistiller(g, fresh, DistillConfig(seq_len=64), opt, step_fn=step)
        m = d.update([ex])
        out[w] = (m["loss"], jax.device_get(d.state.opt_state))
    l1, g1 = out[1.0]
    assert l1 > 0 and any(np.abs(np.asarray(a)).max() > 0 for a in jax.tree.leaves(g1))
    for w in (2.5, 0.25):
        lw, gw = out[w]
        np.testing.assert_allclose(lw, w * l1, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(gw)):
            want = w * np.asarray(a)
            np.testing.assert_allclose(b, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def _pair(task, prompt, hint, response, **kw):
    """A DistillExample whose teacher prompt is `prompt` with `hint` inserted after token 1."""
    teacher = prompt[:1] + hint + prompt[1:]
    return DistillExample(prompt, teacher, response, "h", task, hint_span=(1, 1 + len(hint)),
                          **kw)


def test_pack_pairs_is_the_segments_packer_on_each_side():
    """Each side of pack_pairs equals pack_segments of that side's segments (prompt ++
    response, loss and recorded log-probs / sampling parameters on the response), when
    the first-fit-decreasing rows coincide (one hint length: same order)."""
    hint = [90, 91]
    exs = [_pair("a", [1, 2, 3, 4, 5, 6], hint, [7, 8, 9], response_logprobs=[-.1, -.2, -.3],
                 temperature=0.7, top_k=5, top_p=0.9, weight=2.0),
           _pair("b", [11, 12], hint, [13, 14], response_mask=[1.0, 0.0],
                 response_logprobs=[-.4, -.5], temperature=0.0),
           _pair("a", [21, 22, 23], hint, [24], weight=0.5)]  # no log-probs, not recorded

    def segment(e, prompt):
        p, _n = len(prompt), len(prompt) + len(e.response)
        t = 1.0 if e.temperature is None else e.temperature
        k, tp = (0, 1.0) if e.temperature is None else (e.top_k, e.top_p)
        lps = [0.0] * p + (e.response_logprobs or [0.0] * len(e.response))
        flags = lambda on: [0.0] * p + [float(on)] * len(e.response)  # noqa: E731
        features = {SAMPLER_LOGPROBS: lps, SAMPLING_RECORDED: flags(e.temperature is not None),
                    LOGPROBS_RECORDED: flags(e.temperature is not None
                                             and e.response_logprobs is not None)}
        return Segment(prompt + e.response, [0] * p + e.trained_mask().tolist(), task=e.task,
                       features=features, weight=e.weight, temperature=[1.0] * p + [t] * len(e.response),
                       top_k=[0] * p + [k] * len(e.response),
                       top_p=[1.0] * p + [tp] * len(e.response))

    # seq_len 12: rows {0} and {1, 2} for the teacher lengths (11 | 6 + 6) and the student's.
    paired = pack_pairs(exs, 12)
    assert [s[0] for s in paired.spans] == [0, 1, 1]
    for side, prompts in (("student", [e.student_prompt for e in exs]),
                          ("teacher", [e.teacher_prompt for e in exs])):
        want = pack_segments([segment(e, p) for e, p in zip(exs, prompts)], 12)
        got = getattr(paired, side)
        for field in ("tokens", "targets", "positions", "segment_ids", "loss_mask",
                      "task_ids", "segment_index", "loss_weight", "temperature", "top_k",
                      "top_p"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field),
                                          err_msg=f"{side}.{field}")
        assert got.features.keys() == want.features.keys() == {
            SAMPLER_LOGPROBS, SAMPLING_RECORDED, LOGPROBS_RECORDED}
        for k in want.features:
            np.testing.assert_array_equal(got.features[k], want.features[k], err_msg=side)
    s, t, idx = paired.student, paired.teacher, paired.teacher_index
    rows, cols = np.nonzero(s.loss_mask)
    np.testing.assert_array_equal(t.targets[rows, idx[rows, cols]], s.targets[rows, cols])
    assert s.loss_mask.sum() == 3 + 1 + 1  # response_mask keeps 1 of b's 2 tokens


def test_a_trace_whose_hint_cannot_be_inserted_is_skipped_and_counted(tok, trace, caplog):
    """Finding 6 (issue 32): one trace whose hint could not be inserted (insert_hint
    ValueError) aborted the whole distillation data path."""
    import copy
    import logging
    bad = copy.deepcopy(trace)
    bad.attempt_id = "bad"
    first = bad.episodes[0].completions[0]
    bad.episodes[0].completions[0] = dataclasses.replace(
        first, messages=[{"role": "user", "content": "words the prompt never held"}],
        messages_delta=None, messages_sha=None)
    bad2 = copy.deepcopy(bad)
    bad2.attempt_id = "bad2"
    counts: dict = {}
    with caplog.at_level(logging.WARNING):
        exs = examples_from_traces([bad, trace, bad2], tok, counts=counts)
    assert {e.task for e in exs} == {trace.key}  # the good trace, whole
    assert len(exs) == len(examples_from_traces([trace], tok))
    assert counts["skipped_traces"] == 2 and counts["skipped/hint_not_insertable"] == 2
    warned = [r for r in caplog.records if "hint_not_insertable" in r.getMessage()]
    assert len(warned) == 1  # logged once, not per trace


def test_a_too_long_example_is_cut_or_skipped_and_counted():
    """Finding 5 (issue 61): pack_pairs raised on an example longer than seq_len, so one
    long trace stopped the run. Now its response's end is cut to fit (counted
    `cut/too_long`) or, when its prompt leaves no trained token, it is skipped
    (`skipped/too_long`); `too_long_tokens` counts the trained tokens left out."""
    hint = [90, 91]
    exs = [_pair("a", [1, 2, 3], hint, [4, 5, 6, 7, 8, 9], response_mask=[1, 1, 0, 1, 1, 1],
                 response_logprobs=[-.1, -.2, -.3, -.4, -.5, -.6], temperature=0.7),
           _pair("b", list(range(10, 17)), hint, [21, 22]),  # teacher prompt 9 > 8: skipped
           _pair("c", [30, 31], hint, [32, 33]),
           _pair("d", [40, 41, 42, 43], hint, [44, 45, 46], response_mask=[0, 0, 1])]
    # "d": 6 + 3 > 8 and the 2 tokens that fit are context (mask 0): skipped too
    paired = pack_pairs(exs, 8)
    assert paired.counts == {"skipped/too_long": 2, "cut/too_long": 1, "too_long_tokens": 3 + 2 + 1}
    assert [e.task for e in paired.examples] == ["a", "c"]
    a = paired.examples[0]
    assert a.response == [4, 5, 6] and a.response_mask == [1, 1, 0]
    assert a.response_logprobs == [-.1, -.2, -.3] and a.temperature == 0.7
    assert paired.student.loss_mask.sum() == 2 + 2
    for e, (r, c, _, n) in zip(paired.examples, paired.spans):
        assert paired.student.targets[r, c:c + n].tolist() == e.response
    assert exs[0].response == [4, 5, 6, 7, 8, 9]  # the caller's examples are not changed
    # nothing fits: an all-padding batch that trains nothing, counted
    none = pack_pairs(exs[1:2], 8)
    assert none.examples == [] and none.student.loss_mask.sum() == 0
    assert none.counts["skipped/too_long"] == 1
    # what fits is untouched and counted as such
    assert pack_pairs(exs, 16).counts == {"skipped/too_long": 0, "cut/too_long": 0,
                                          "too_long_tokens": 0}


def test_response_spans_are_checked_and_cut_with_the_response():
    hint = [90]
    e = _pair("a", [1, 2], hint, [3, 4, 5, 6, 7, 8], response_mask=[1, 1, 0, 1, 1, 0],
              response_spans=[(0, 2), (3, 5)])
    paired = pack_pairs([e], 6)  # room 3: the second response is cut to nothing
    assert paired.examples[0].response_spans == [(0, 2)]
    r, c, _, n = paired.spans[0]
    assert paired.response_ids[r, c:c + n].tolist() == [1, 1, 0]
    whole = pack_pairs([e, _pair("b", [1], hint, [9, 9])], 16)
    ids = [whole.gather_response(whole.response_ids, i).tolist() for i in range(2)]
    assert sorted(ids) == sorted([[1, 1, 0, 2, 2, 0], [3, 3]]) or sorted(ids) == sorted(
        [[2, 2, 0, 3, 3, 0], [1, 1]])
    for bad in ([(0, 2), (1, 5)], [(2, 1)], [(0, 7)], []):
        with pytest.raises(ValueError, match="response_spans"):
            dataclasses.replace(e, response_spans=bad)
    with pytest.raises(ValueError, match="every trained response token"):
        dataclasses.replace(e, response_spans=[(0, 2)])


def test_grammar_constrained_responses_are_skipped_and_counted_by_the_sampled_kind(
        tok, model_state, trace):
    """Issue 61 (review): a completion sampled under a grammar (`Completion.constraint`)
    recorded log-probs under the grammar's mask, but kind="sampled" scored it with the
    unmasked student (biased log-ratio and importance weight). Such a response is its
    own example (never merged with unconstrained turns) carrying its grammar, and
    kind="sampled" leaves it out and counts it (`skipped/constrained`); the
    full-vocabulary kinds train it as before."""
    import copy
    tr = copy.deepcopy(trace)
    constrained = tr.episodes[0].completions[1]  # main's 2nd turn (a tool call)
    constrained.constraint = '%llguidance {}\nstart: /[a-z]+/'
    merged = examples_from_traces([trace], tok, config=HintConfig(placement="system"))
    exs = examples_from_traces([tr], tok, config=HintConfig(placement="system"))
    assert len(exs) == len(merged) + 1  # the constrained turn is not merged
    assert [e.constraint for e in exs].count(constrained.constraint) == 1
    assert [e.response for e in exs if e.constraint] == [constrained.output_ids]
    n = len(constrained.output_ids)
    g, st = model_state
    cfg = DistillConfig(kind="sampled", seq_len=SEQ)
    d = SelfDistiller(g, jax.tree.map(jnp.copy, st), cfg, OPT, donate=False)
    m = d.update(exs)
    assert m["skipped"] == 0 and m["skipped/constrained"] == 1
    assert m["kept_tokens"] == trace.num_agent_tokens - n
    assert all(e.constraint is None for e in d.last_examples)
    d = SelfDistiller(g, jax.tree.map(jnp.copy, st), dataclasses.replace(cfg, kind="reverse_kl"),
                      OPT, donate=False)
    batch, _ = d.prepare(exs)
    assert d.last_counts["skipped/constrained"] == 0
    assert batch.loss_mask.sum() == trace.num_agent_tokens
    # a step whose every example is constrained makes no update and says why
    d = SelfDistiller(g, jax.tree.map(jnp.copy, st), cfg, OPT, donate=False)
    m = d.update([e for e in exs if e.constraint])
    assert m["skipped"] == 1 and m["skipped/constrained"] == 1
