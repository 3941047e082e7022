"""Offline distillation data (`training/distill/traces.py`) and RMSD's selection on it.

A property test over random agent traces (episodes of plain turns followed by a
user message, or tool calls followed by their result; the endpoint's prompt
splicing and recorder) and random layouts (hint placement, merge on or off,
top-T): RMSD keeps the T largest-divergence positions of every model response
(each request's output span), whatever the packing. The divergence is a fixed
function of each token's full prefix (a hash), so merged and split layouts see
the same value at the same token and the selection can be compared exactly; the
selection code (candidates, judge, kept mask) is the trainer's own.
"""

import collections
import hashlib
import json
from unittest import mock

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.segments.batch import pow2_bucket
from ac2_jax.serving.core.splice import TurnMemory, build_prompt_ids
from ac2_jax.text import parse_tool_calls
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.trace.recorder import TraceRecorder
from ac2_jax.trace.types import Completion, Trace
from ac2_jax.training import OptimizerConfig, create_train_state
from ac2_jax.training.distill import (
    DistillConfig,
    HintConfig,
    SelfDistiller,
    examples_from_traces,
    pack_pairs,
)
from ac2_jax.training.distill.data import HINT_PLACEMENTS
from tests.support.serving_helpers import SYSTEM, TOOLS

HINT = "Add all three numbers before answering."
WORDS = "red blue green the sum is seven ten add numbers".split()
AGENTS = ("main", "compactor", "subagent:helper")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")),
                                extra_corpus=[HINT, " ".join(WORDS)] * 20)


@pytest.fixture(scope="module")
def model_state(tok):
    model = Decoder(DecoderConfig.tiny(vocab_size=tok.vocab_size, num_layers=1),
                    rngs=nnx.Rngs(0))
    return create_train_state(model, OptimizerConfig(), rng=0)


def _divergence(prefix) -> float:
    """The synthetic divergence of the last token of `prefix` (ids), in [0, 1)."""
    h = hashlib.blake2b(np.asarray(prefix, np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0**64


def _fake_relevance_scores(graphdef, params, teacher_params, rest, b, extras, loss):
    """relevance_scores' (divergence [R, L], teacher argmax [R, L]) from the student rows:
    column p predicts targets[p] after the segment's tokens up to p."""
    tokens, targets, pos, seg = (np.asarray(x) for x in (b.tokens, b.targets, b.positions,
                                                          b.segment_ids))
    div = np.zeros(tokens.shape, np.float32)
    for r, p in zip(*np.nonzero((seg > 0) & (np.asarray(b.loss_mask) > 0))):
        div[r, p] = _divergence(list(tokens[r, p - pos[r, p]:p + 1]) + [targets[r, p]])
    return jnp.asarray(div), jnp.asarray(targets)


class _SelectAll:
    def select(self, example):
        return list(example.candidates)


def _random_trace(data, tok) -> Trace:
    trace = Trace("t", attempt_id="0", hints=[HINT], status="finished")
    rec = TraceRecorder(trace)
    for agent in data.draw(st.lists(st.sampled_from(AGENTS), min_size=1, max_size=3)):
        memory = TurnMemory()
        messages = [SYSTEM, {"role": "user", "content": "What is the sum?"}]
        for _ in range(data.draw(st.integers(1, 3))):
            prompt, _ = build_prompt_ids(tok, messages, TOOLS, memory)
            if data.draw(st.booleans()):
                a, b = data.draw(st.integers(0, 99)), data.draw(st.integers(0, 99))
                call = {"name": "add", "arguments": {"a": a, "b": b}}
                text = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
            else:
                text = " ".join(data.draw(st.lists(st.sampled_from(WORDS), min_size=1,
                                                   max_size=6)))
            out = tok.encode(text) + [tok.eos_token_id]
            rec.record(agent, Completion(prompt, out, [-0.5] * len(out),
                                         messages=[dict(m) for m in messages]))
            content, calls = parse_tool_calls(text)
            memory.remember(content, calls, out)
            messages = messages + [{"role": "assistant", "content": content or None,
                                    "tool_calls": calls or None}]
            if calls:
                messages += [{"role": "tool", "tool_call_id": c["id"], "content": "7"}
                             for c in calls]
            else:
                messages += [{"role": "user", "content": data.draw(
                    st.sampled_from(["Go on.", "And then?"]))}]
    return trace


@settings(max_examples=80, deadline=None, database=None)
@given(st.data())
def test_rmsd_keeps_the_top_t_of_every_response_whatever_the_layout(tok, model_state, data):
    trace = _random_trace(data, tok)
    placement = data.draw(st.sampled_from(HINT_PLACEMENTS))
    merge = data.draw(st.booleans())
    top_t = data.draw(st.integers(1, 5))
    examples = examples_from_traces([trace], tok, config=HintConfig(placement=placement),
                                    merge=merge)
    # what RMSD must keep: the top_t divergences of each request's output span
    want = collections.Counter()
    for ep in trace.episodes:
        for c in ep.completions:
            values = [float(np.float32(_divergence(list(c.prompt_ids) + list(c.output_ids[:j + 1]))))
                      for j in range(len(c.output_ids))]
            want.update(sorted(values, reverse=True)[:top_t])
    g, state = model_state
    d = SelfDistiller(g, state, DistillConfig(method="rmsd", top_t=top_t), OptimizerConfig(),
                      judge=_SelectAll(), tokenizer=tok, donate=False)
    # Few shapes (>= 512 columns, rows a multiple of 4): the selection's array ops then
    # compile for a handful of batch shapes, not for every example's own.
    seq_len = max(512, pow2_bucket(max(len(e.teacher_prompt) + len(e.response) for e in examples)))
    paired = pack_pairs(examples, seq_len, rows_multiple=4)
    with mock.patch("ac2_jax.training.distill.trainer.relevance_scores", _fake_relevance_scores):
        kept, rel = d.relevance(paired)
    div, _ = _fake_relevance_scores(None, None, None, None, paired.student, None, None)
    got = collections.Counter(np.asarray(div)[np.asarray(kept) > 0].tolist())
    assert got == want, (placement, merge, top_t, len(examples))
    assert sum(len(s) for s in rel.selected) == sum(want.values())
