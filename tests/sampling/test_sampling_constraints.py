"""sampling/constraints.py: grammar builders, matcher, replay_masks, and the
JaxSampler's masked decoding (tokens, log-probs and masks against a full
forward pass of the tiny model with the replayed masks, fp32).

One sampler per module, one row count and cache length: few compiles.
"""

import asyncio
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ac2_jax.losses import sampling_logits
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.sampling import (
    ConstraintError,
    GrammarMatcher,
    SamplerError,
    SamplingParams,
    any_json_grammar,
    check_grammar,
    end_token_id,
    json_schema_grammar,
    ll_tokenizer,
    replay_masks,
    tool_call_grammar,
)
from ac2_jax.sampling.engine import jax_sampler as jax_sampler_mod
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.text import Tokenizer
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer

CTX = 128
EXTRA_IDS = 60  # the model's vocabulary is larger than the tokenizer's
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}
ECHO = {"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["text"],
    "properties": {"text": {"type": "string", "maxLength": 6}}}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: {}
TOOLS = [ADD, ECHO, PING]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def model(tok):
    cfg = DecoderConfig.tiny(vocab_size=tok.vocab_size + EXTRA_IDS, hidden_size=32,
                             intermediate_size=64, num_heads=2, num_kv_heads=1, head_dim=16,
                             max_position_embeddings=CTX, initializer_range=0.5)
    return Decoder(cfg, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def sampler(model, tok):
    s = JaxSampler(model, max_context=CTX, max_batch=4, min_batch=4, min_cache_len=CTX,
                   steps_per_sync=4, max_top_logprobs=4, prefill_chunk=16, min_prefill_rows=4,
                   eos_token_ids=tok.stop_token_ids, tokenizer=tok, seed=0)
    yield s
    s.close()


def prompt(tok, text="call a tool"):
    return tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def gen_many(sampler, reqs):
    async def go():
        return await asyncio.gather(*[sampler.generate(p, sp) for p, sp in reqs],
                                    return_exceptions=True)
    return asyncio.run(go())


def accepts(grammar, tok, text, end=True) -> bool:
    ids = tok.encode(text) + ([end_token_id(tok)] if end else [])
    try:
        replay_masks(grammar, tok, ids)
    except ConstraintError:
        return False
    return True


@functools.partial(jax.jit, static_argnums=(4, 5, 6))
def _masked_logprobs(graphdef, state, tokens, masks, temperature, top_k, top_p):
    """tokens [1, CTX] (a causal forward: the padding after the sequence changes no
    earlier position), masks [CTX, V]: (masked logits, log-probs) [CTX, V]. One shape
    for every request: one compile per sampling setting, not per length."""
    pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    logits = nnx.merge(graphdef, state)(tokens, pos, jnp.ones_like(tokens))[0]
    masked = jnp.where(masks, logits, -jnp.inf)
    return masked, jax.nn.log_softmax(sampling_logits(masked, temperature, top_k, top_p), -1)


def masked_logprobs(model, tok, p, r, grammar, sp):
    """The learner's view: one full forward pass over prompt + output, the replayed
    masks, then sampling_logits and log_softmax. Returns (masked logits [n, V],
    log-probs [n, V], masks [n, V])."""
    n = len(r.output_ids)
    seq = np.zeros((1, CTX), np.int32)
    seq[0, :len(p) + n] = p + r.output_ids
    masks = replay_masks(grammar, tok, r.output_ids, vocab_size=model.config.vocab_size)
    padded = np.ones((CTX, model.config.vocab_size), bool)
    at = slice(len(p) - 1, len(p) - 1 + n)  # the positions that predict the outputs
    padded[at] = masks
    masked, logp = _masked_logprobs(*nnx.split(model), seq, padded, sp.temperature, sp.top_k,
                                    sp.top_p)
    return np.asarray(masked)[at], np.asarray(logp)[at], masks


# ------------------------------------------------------------------------------ grammars


def test_tool_call_grammar_takes_the_hermes_format_and_only_it(tok):
    g = tool_call_grammar(tok, TOOLS)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 42}}\n</tool_call>'
    ping = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    assert accepts(g, tok, call) and accepts(g, tok, ping)
    assert accepts(g, tok, call + "\n" + ping)  # parallel calls, joined as the template does
    assert accepts(g, tok, call[:20], end=False)  # an unfinished output replays too
    for bad in ['<tool_call>\n{"name": "sub", "arguments": {}}\n</tool_call>',  # no such tool
                '<tool_call>\n{"name": "add", "arguments": {"a": 3}}\n</tool_call>',  # b missing
                '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": "x"}}\n</tool_call>',
                '<tool_call>\n{"name": "add", "arguments": {"a": 3,"b": 4}}\n</tool_call>',
                '<tool_call>\n{"name": "ping", "arguments": {"x": 1}}\n</tool_call>',
                "Sure, " + call, call + " done"]:
        assert not accepts(g, tok, bad), bad
    one = tool_call_grammar(tok, TOOLS, parallel=False)
    assert accepts(one, tok, call) and not accepts(one, tok, call + "\n" + ping)
    named = tool_call_grammar(tok, TOOLS, name="ping")
    assert accepts(named, tok, ping) and not accepts(named, tok, call)


def test_tool_call_grammar_ends_the_turn_with_the_eos_the_template_writes(tok):
    """After a complete call only the EOS (or, for parallel calls, a newline) may
    follow; with one call the EOS is forced (one allowed id)."""
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    rendered = tok.apply_chat_template(
        [{"role": "assistant", "tool_calls": [
            {"type": "function", "function": {"name": "ping", "arguments": "{}"}}]}],
        add_generation_prompt=False)
    assert call + tok.eos_token in rendered
    ids = tok.encode(call) + [tok.eos_token_id]
    one = replay_masks(tool_call_grammar(tok, TOOLS, parallel=False), tok, ids)
    assert np.flatnonzero(one[-1]).tolist() == [tok.eos_token_id]
    par = replay_masks(tool_call_grammar(tok, TOOLS), tok, ids)
    assert set(np.flatnonzero(par[-1])) == {tok.eos_token_id, tok.encode("\n")[0]}
    assert not par[:-1, tok.eos_token_id].any()  # no end before the call is complete
    other_stops = [t for t in tok.stop_token_ids if t != tok.eos_token_id]
    assert other_stops and not par[:, other_stops].any()


def test_json_schema_and_any_json_grammars(tok):
    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"enum": ["x", "y"]}}},
              "required": ["n"], "additionalProperties": False}
    g = json_schema_grammar(schema)
    assert accepts(g, tok, json.dumps({"n": 3, "tags": ["x", "y"]}))
    assert not accepts(g, tok, json.dumps({"tags": ["x"]}))
    assert not accepts(g, tok, json.dumps({"n": 3, "tags": ["z"]}))
    assert not accepts(g, tok, '{"n":3}')  # compact JSON_STYLE: json.dumps separators
    a = any_json_grammar()
    assert accepts(a, tok, json.dumps({"k": [1, {"z": None}]})) and not accepts(a, tok, "[1]")
    assert accepts(json_schema_grammar({"type": "boolean"}), tok, "true")


def test_bad_grammars_and_bad_builder_input_are_value_errors(tok):
    for bad, says in [("start: foo", "unknown name"), ("start: <nope>", "special token"),
                      ('start: %json {"type": "nonsense"}', "nonsense"), ("", "non-empty")]:
        with pytest.raises(ValueError, match=says):
            check_grammar(bad, tok)
        with pytest.raises(ValueError, match=says):
            GrammarMatcher(bad, tok)
    with pytest.raises(ValueError, match="nonsense"):
        check_grammar(json_schema_grammar({"type": "nonsense"}), tok)
    with pytest.raises(ValueError, match="no tool named 'sub'"):
        tool_call_grammar(tok, TOOLS, name="sub")
    with pytest.raises(ValueError, match="tools"):
        tool_call_grammar(tok, [])
    with pytest.raises(ValueError, match=r"tools\[0\]"):
        tool_call_grammar(tok, [{"type": "function"}])
    xml = Tokenizer(tok.hf, special_tokens=tok.special_tokens, tool_parser="qwen3_coder")
    with pytest.raises(ValueError, match="qwen3_coder"):
        tool_call_grammar(xml, TOOLS)
    with pytest.raises(TypeError, match="ac2_jax.text.Tokenizer"):
        ll_tokenizer(object())
    with pytest.raises(ValueError, match="constraint"):
        SamplingParams(constraint="")


def test_matcher_steps_and_model_vocab_beyond_the_tokenizer(tok):
    V = tok.vocab_size + EXTRA_IDS
    m = GrammarMatcher(json_schema_grammar({"type": "boolean"}), tok, vocab_size=V)
    first = m.allowed()
    assert first.shape == (V,) and not first[tok.vocab_size:].any()
    assert {tok.decode([i]) for i in np.flatnonzero(first)} == {"t", "f"}
    with pytest.raises(ConstraintError, match="token .* position 0 is not allowed"):
        m.consume(tok.encode("x")[0])
    m = GrammarMatcher(json_schema_grammar({"type": "boolean"}), tok, vocab_size=V)
    for t in tok.encode("true"):
        assert not m.is_accepting()
        m.consume(t)
    assert m.is_accepting() and m.is_stopped()
    assert np.flatnonzero(m.allowed()).tolist() == [tok.eos_token_id]
    assert ll_tokenizer(tok) is ll_tokenizer(tok)  # built once per tokenizer


# ------------------------------------------------------------------------------ the sampler


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (1.0, 12, 1.0),
                                                     (1.0, -1, 0.8)])
def test_sampled_logprobs_are_the_masked_distribution_of_a_full_forward(
        sampler, model, tok, temperature, top_k, top_p):
    """Recorded log-probs = log_softmax(sampling_logits(masked logits)) from one full
    forward with replay_masks, fp32, atol 1e-5; every token inside its mask; a
    position with one allowed id has log-prob 0 exactly; the call parses."""
    g = tool_call_grammar(tok, TOOLS)
    reqs = [(prompt(tok, f"task {i}"), SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=80, seed=i,
        constraint=g)) for i in range(4)]
    results = gen_many(sampler, reqs)
    for (p, sp), r in zip(reqs, results):
        assert not isinstance(r, BaseException), r
        _, logp, masks = masked_logprobs(model, tok, p, r, g, sp)
        ids = np.asarray(r.output_ids)
        assert masks[np.arange(len(ids)), ids].all()
        want = logp[np.arange(len(ids)), ids]
        np.testing.assert_allclose(r.output_logprobs, want, atol=1e-5, rtol=0)
        forced = masks.sum(-1) == 1
        assert forced.any() and all(r.output_logprobs[i] == 0.0 for i in np.flatnonzero(forced))
        if r.finish_reason == "stop":
            assert ids[-1] == tok.eos_token_id
            content, calls = tok.parse_tool_calls(tok.decode(ids[:-1]))
            assert calls and content == ""


def test_greedy_is_the_argmax_of_the_masked_logits(sampler, model, tok):
    g = json_schema_grammar({"type": "object", "additionalProperties": False,
                             "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    p = prompt(tok, "json please")
    sp = SamplingParams(temperature=0.0, max_tokens=30, constraint=g)
    (r,) = gen_many(sampler, [(p, sp)])
    masked, logp, _ = masked_logprobs(model, tok, p, r, g, sp)
    np.testing.assert_array_equal(np.argmax(masked, -1), r.output_ids)
    ids = np.asarray(r.output_ids)
    np.testing.assert_allclose(r.output_logprobs, logp[np.arange(len(ids)), ids], atol=1e-5)
    assert r.finish_reason == "stop" and json.loads(tok.decode(r.output_ids[:-1]))["ok"] in (
        True, False)


def test_replay_masks_equal_the_masks_the_sampler_applied(sampler, tok, monkeypatch):
    """The worker's own bitmasks (recorded as it fills them) equal replay_masks, row
    for row, for several constrained rows sharing a batch with a free one."""
    applied: dict[int, list[np.ndarray]] = {}

    class Recording(GrammarMatcher):
        def fill_bitmask(self, out):
            super().fill_bitmask(out)
            applied.setdefault(id(self), []).append(out.copy())

    made: list[Recording] = []

    def make(*a, **k):
        made.append(Recording(*a, **k))
        return made[-1]

    monkeypatch.setattr(jax_sampler_mod, "GrammarMatcher", make)
    grammars = [tool_call_grammar(tok, TOOLS), tool_call_grammar(tok, TOOLS, name="echo"),
                any_json_grammar()]
    reqs = [(prompt(tok, f"q{i}"), SamplingParams(temperature=1.0, max_tokens=60, seed=10 + i,
                                                 constraint=g)) for i, g in enumerate(grammars)]
    reqs.append((prompt(tok, "free"), SamplingParams(temperature=1.0, max_tokens=20, seed=3)))
    results = gen_many(sampler, reqs)
    assert len(made) == 3
    V = sampler.vocab_size
    for m in made:  # built in threads: in any order
        g = m.grammar
        r = results[grammars.index(g)]
        got = np.unpackbits(np.stack(applied[id(m)]).view(np.uint8), axis=-1,
                            bitorder="little")[:, :V].astype(bool)
        np.testing.assert_array_equal(got, replay_masks(g, tok, r.output_ids, vocab_size=V))
        packed = replay_masks(g, tok, r.output_ids, vocab_size=V, packed=True)
        assert packed.dtype == np.uint32  # the sampler's own words, bit for bit
        np.testing.assert_array_equal(packed, np.stack(applied[id(m)]))
    assert len(results[3].output_ids) == 20  # the free row ran its course beside them


def test_same_seed_same_tokens_and_max_tokens_is_length(sampler, tok):
    g = tool_call_grammar(tok, TOOLS, name="echo", parallel=False)
    sp = SamplingParams(temperature=1.0, max_tokens=60, seed=77, constraint=g)
    a, b = gen_many(sampler, [(prompt(tok), sp), (prompt(tok), sp)])
    (c,) = gen_many(sampler, [(prompt(tok), sp)])
    assert a.output_ids == b.output_ids == c.output_ids
    assert a.output_logprobs == c.output_logprobs
    short = sp.replace(max_tokens=5)
    (d,) = gen_many(sampler, [(prompt(tok), short)])
    assert d.finish_reason == "length" and d.output_ids == a.output_ids[:5]


def test_a_failing_matcher_fails_its_request_only(sampler, tok, monkeypatch):
    class Breaks(GrammarMatcher):
        def fill_bitmask(self, out):
            if self.n_consumed == 3:
                raise ConstraintError("grammar broke on purpose")
            super().fill_bitmask(out)

    monkeypatch.setattr(jax_sampler_mod, "GrammarMatcher", Breaks)
    g = tool_call_grammar(tok, TOOLS)
    reqs = [(prompt(tok), SamplingParams(max_tokens=30, seed=1, constraint=g)),
            (prompt(tok), SamplingParams(max_tokens=12, seed=2)),
            (prompt(tok, "x"), SamplingParams(max_tokens=12, seed=3))]
    bad, ok1, ok2 = gen_many(sampler, reqs)
    assert isinstance(bad, SamplerError) and "broke on purpose" in str(bad)
    assert len(ok1.output_ids) == len(ok2.output_ids) == 12


def test_requests_that_cannot_be_constrained_are_refused(sampler, model, tok):
    with pytest.raises(ValueError, match="constraint.*unknown name"):
        asyncio.run(sampler.generate(prompt(tok), SamplingParams(constraint="start: foo")))
    bare = JaxSampler(model, max_context=CTX, max_batch=1, eos_token_ids=tok.stop_token_ids)
    try:
        with pytest.raises(ValueError, match="constraint needs the JaxSampler's tokenizer"):
            asyncio.run(bare.generate(prompt(tok), SamplingParams(constraint=any_json_grammar())))
    finally:
        bare.close()
    other_eos = JaxSampler(model, max_context=CTX, max_batch=1, tokenizer=tok,
                           eos_token_ids=[t for t in tok.stop_token_ids if t != tok.eos_token_id])
    try:
        with pytest.raises(ValueError, match="not a stop token of this request"):
            asyncio.run(other_eos.generate(prompt(tok),
                                           SamplingParams(constraint=any_json_grammar())))
    finally:
        other_eos.close()


def test_unconstrained_traffic_never_runs_the_masked_chunk(model, tok):
    with JaxSampler(model, max_context=CTX, max_batch=2, min_batch=2, min_cache_len=CTX,
                    tokenizer=tok, eos_token_ids=tok.stop_token_ids) as s:
        gen_many(s, [(prompt(tok), SamplingParams(max_tokens=8, seed=i)) for i in range(2)])
        kinds = {k[0] for k in s.stats.shapes}
        assert "decode_chunk" in kinds and "decode_masked" not in kinds
