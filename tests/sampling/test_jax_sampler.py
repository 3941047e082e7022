"""JaxSampler on a tiny random fp32 decoder: numerics against the learner's
full forward pass, sampling controls, batching, weight loads, errors.

One sampler per module with a single row count and cache length keeps the
compiles few (they dominate the run time on CPU).
"""

import asyncio
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from ac2_jax.losses import token_logprobs
from ac2_jax.models import Decoder, DecoderConfig, publish_weights
from ac2_jax.sampling import (
    ContextLengthError,
    Sampler,
    SamplerError,
    SamplerUnavailable,
    SamplingParams,
    truncate_at_stop,
)
from ac2_jax.sampling.engine.jax_sampler import JaxSampler

CTX = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
# A larger init than the default makes the random model's outputs varied.
CONFIG = DecoderConfig.tiny(vocab_size=256, initializer_range=0.5)


def _model(seed=0):
    return Decoder(CONFIG, rngs=nnx.Rngs(seed))


def _sampler(model, **kw):
    kw = {"max_context": CTX, "max_batch": 16, "min_batch": 8, "min_cache_len": CTX,
          "steps_per_sync": 4, "max_top_logprobs": 4, "seed": 0, "prefill_chunk": 16,
          "min_prefill_rows": 8, **kw}
    return JaxSampler(model, **kw)


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def sampler(model):
    s = _sampler(model)
    yield s
    s.close()


def run(coro):
    return asyncio.run(coro)


def gen(sampler, prompt, params=GREEDY):
    return run(sampler.generate(prompt, params))


def gen_many(sampler, reqs):
    async def go():
        return await asyncio.gather(*[sampler.generate(p, sp) for p, sp in reqs])
    return run(go())


def prompt_of(i, n=6):
    return [(7 * i + 3 * j + 1) % 256 for j in range(n)]


# The references' log-probs as one compiled program per shape and sampling setting:
# eagerly, each of token_logprobs' ~25 ops compiled for every response length.
ref_logprobs = jax.jit(token_logprobs, static_argnames=("temperature", "top_k", "top_p"))


@jax.jit
def _learner_forward(graphdef, state, tokens, positions, segs, targets):
    logits = nnx.merge(graphdef, state)(tokens, positions, segs)
    return logits[0], token_logprobs(logits, targets)[0]


def learner(model, seqs, row_len=128):
    """The learner's view: one packed row holding all `seqs` (PackedBatch layout,
    targets[p] = tokens[p + 1] within a segment). Per seq: (logits [L, V],
    logprobs [L] of the next token, the last one meaningless)."""
    tokens, positions, segs, targets = (np.zeros((1, row_len), np.int32) for _ in range(4))
    start = 0
    for i, s in enumerate(seqs):
        sl = slice(start, start + len(s))
        tokens[0, sl], positions[0, sl], segs[0, sl] = s, np.arange(len(s)), i + 1
        targets[0, start:start + len(s) - 1] = s[1:]
        start += len(s)
    assert start <= row_len
    logits, lps = jax.device_get(_learner_forward(*nnx.split(model), tokens, positions, segs,
                                                  targets))
    out, start = [], 0
    for s in seqs:
        out.append((logits[start:start + len(s)], lps[start:start + len(s)]))
        start += len(s)
    return out


def test_is_a_sampler(sampler):
    assert isinstance(sampler, Sampler)
    assert sampler.max_context == CTX and sampler.policy_version == 0


def test_logprobs_equal_learner_forward(sampler, model):
    reqs = [(prompt_of(0), GREEDY),
            (prompt_of(1, 9), SamplingParams(temperature=1.0, max_tokens=15, seed=1)),
            (prompt_of(2, 3), SamplingParams(temperature=0.7, top_p=0.8, max_tokens=10, seed=2)),
            (prompt_of(3, 12), SamplingParams(temperature=1.3, top_k=5, max_tokens=20, seed=3))]
    results = gen_many(sampler, reqs)
    seqs = [p + r.output_ids for (p, _), r in zip(reqs, results)]
    for (p, sp), r, (logits, _) in zip(reqs, results, learner(model, seqs)):
        assert len(r.output_ids) == sp.max_tokens and r.finish_reason == "length"
        # The behaviour distribution: temperature, top-k, top-p (greedy: raw logits).
        want = ref_logprobs(logits[len(p) - 1:-1], np.asarray(r.output_ids),
                            temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p)
        np.testing.assert_allclose(r.output_logprobs, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.3, 20, 0.9), (1.0, -1, 1.0)])
def test_on_policy_ratio_and_tis_are_one_through_the_training_batch(sampler, model, temperature,
                                                                   top_k, top_p):
    """Sampled tokens -> Completion -> trace -> packed batch -> the PG loss's learner log-probs
    equal the recorded behaviour log-probs to 2e-5 (fp32), so ratio and TIS weight are 1.
    (The decode and full-forward paths round the logits differently, ~3e-6, and
    temperature 0.3 scales that by 1 / 0.3: one draw of the inverse-CDF sampler
    landed at 1.07e-5.)"""
    from ac2_jax.segments import pack_segments, segments_from_trace
    from ac2_jax.trace.recorder import TraceRecorder
    from ac2_jax.trace.types import Completion, Trace
    from ac2_jax.training.core.objectives import behaviour_logprobs
    from ac2_jax.training.core.train_step import forward

    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=10)
    reqs = [(prompt_of(20 + i, 5 + i), params.replace(seed=i)) for i in range(6)]
    trace = Trace(task_id="t")
    rec = TraceRecorder(trace)
    for (p, sp), r in zip(reqs, gen_many(sampler, reqs)):
        rec.record(f"agent{len(trace.episodes)}", Completion(
            p, r.output_ids, r.output_logprobs, temperature=sp.temperature, top_k=sp.top_k,
            top_p=sp.top_p))
    batch = pack_segments(segments_from_trace(trace), seq_len=64)
    logits = jax.jit(forward, static_argnums=0)(*nnx.split(model, nnx.Param, ...), batch)
    logp = np.asarray(jax.jit(behaviour_logprobs)(logits, batch))
    m = batch.loss_mask > 0
    assert m.sum() == 60
    np.testing.assert_allclose(logp[m], batch.features["sampler_logprobs"][m], atol=2e-5, rtol=0)
    ratio_to_sampler = np.exp(logp[m] - batch.features["sampler_logprobs"][m])
    np.testing.assert_allclose(ratio_to_sampler, 1.0, atol=3e-5)
    if top_k > 0:  # the raw distribution would be far off: the old bug
        raw = np.asarray(ref_logprobs(logits, batch.targets))
        assert np.abs(raw[m] - batch.features["sampler_logprobs"][m]).max() > 0.1


def test_greedy_is_argmax_of_full_forward(sampler, model):
    p = prompt_of(4)
    r = gen(sampler, p, GREEDY.replace(max_tokens=20))
    ((lg, _),) = learner(model, [p + r.output_ids])
    np.testing.assert_array_equal(np.argmax(lg[len(p) - 1:-1], -1), r.output_ids)
    assert len(set(r.output_ids)) > 3  # the model is not degenerate


def test_top_logprobs_match_forward(sampler, model):
    p = prompt_of(5)
    r = gen(sampler, p, SamplingParams(temperature=1.0, max_tokens=6, seed=5, top_logprobs=3))
    ((lg, _),) = learner(model, [p + r.output_ids])
    logp = lg[len(p) - 1:-1] - np.log(np.exp(lg[len(p) - 1:-1]).sum(-1, keepdims=True))
    assert len(r.top_logprobs) == len(r.output_ids)
    for row, lp in zip(r.top_logprobs, logp):
        ids = [i for i, _ in row]
        np.testing.assert_array_equal(ids, np.argsort(-lp)[:3])
        np.testing.assert_allclose([v for _, v in row], lp[ids], atol=1e-4)


def test_same_seed_same_sample_alone_and_in_batch(sampler):
    p, sp = prompt_of(6), SamplingParams(temperature=1.0, max_tokens=16, seed=1234)
    alone = gen(sampler, p, sp)
    others = [(prompt_of(10 + i, 4 + i), SamplingParams(temperature=0.9, top_p=0.9,
                                                      max_tokens=8 + i, seed=i))
              for i in range(7)]
    batch = gen_many(sampler, others[:3] + [(p, sp)] + others[3:])
    assert batch[3].output_ids == alone.output_ids
    np.testing.assert_allclose(batch[3].output_logprobs, alone.output_logprobs, atol=1e-5)
    other_seed = gen(sampler, p, sp.replace(seed=99))
    assert other_seed.output_ids != alone.output_ids


def test_top_k_one_is_greedy(sampler):
    p = prompt_of(7)
    greedy = gen(sampler, p)
    topk1 = gen(sampler, p, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, seed=3))
    assert topk1.output_ids == greedy.output_ids


def test_max_tokens_and_stop_tokens(sampler):
    p = prompt_of(8)
    full = gen(sampler, p, GREEDY.replace(max_tokens=10))
    assert full.finish_reason == "length" and len(full.output_ids) == 10
    k = next(i for i in range(2, 10) if full.output_ids[i] not in full.output_ids[:i])
    stop = full.output_ids[k]
    r = gen(sampler, p, GREEDY.replace(max_tokens=10, stop_token_ids=(stop,)))
    assert r.finish_reason == "stop" and r.output_ids == full.output_ids[:k + 1]
    assert r.output_logprobs == pytest.approx(full.output_logprobs[:k + 1], abs=1e-5)


def test_eos_and_stop_strings(model, sampler):
    class ByteTokenizer:  # a real (byte-level) tokenizer for a 256-token vocabulary
        def decode(self, ids):
            return bytes(ids).decode("latin-1")

    p = prompt_of(9)
    full = gen(sampler, p, GREEDY.replace(max_tokens=12))
    out = full.output_ids
    k = next(i for i in range(2, 12) if out[i] not in out[:i])
    with _sampler(model, eos_token_ids=(out[k],), tokenizer=ByteTokenizer()) as s:
        r = gen(s, p, GREEDY.replace(max_tokens=12))
        assert r.finish_reason == "stop" and r.output_ids == out[:k + 1]
        text = ByteTokenizer().decode(out[1:3])
        r = gen(s, p, GREEDY.replace(max_tokens=12, stop=(text,)))
        want, matched = truncate_at_stop(full, (text,), ByteTokenizer().decode)
        assert matched == text and r.finish_reason == "stop"
        assert r.output_ids == want.output_ids == out[:3]


def test_sixteen_concurrent_requests_are_batched(sampler):
    reqs = [(prompt_of(20 + i, 2 + i % 9), GREEDY.replace(max_tokens=6 + i % 7))
            for i in range(16)]
    solo = [gen(sampler, p, sp) for p, sp in reqs]
    before = sampler.stats.active_rows[16]
    batched = gen_many(sampler, reqs)
    assert sampler.stats.active_rows[16] > before  # decode steps ran with all 16 rows
    for a, b in zip(solo, batched):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-5)


def test_prefix_reuse(sampler, model):
    p = prompt_of(40, 10)
    first = gen(sampler, p)
    turn2 = p + first.output_ids + [5, 6, 7]
    r = gen(sampler, turn2)
    assert r.cached_tokens == len(p) + len(first.output_ids) - 1
    ((lg, lps),) = learner(model, [turn2 + r.output_ids])
    np.testing.assert_allclose(r.output_logprobs, lps[len(turn2) - 1:-1], atol=1e-4)
    np.testing.assert_array_equal(np.argmax(lg[len(turn2) - 1:-1], -1), r.output_ids)


def test_a_groups_shared_prompt_is_prefilled_once(sampler, model):
    """Six attempts of one 22-token prompt prefix (20 shared, then 2 of their own) arrive
    together: one computes the shared 20, the others copy them and compute 1 token each
    (the last prompt token is fed by decode). A seventh sharing only 8 tokens (< SHARE_MIN)
    computes its own. Tokens equal, log-probs to 1e-5 (fp32), against share_prefix=False."""
    shared = [(11 * j + 5) % 256 for j in range(20)]
    prompts = [shared + [200 + i, 100 + i] for i in range(6)] + [shared[:8] + [9] * 14]
    reqs = [(p, SamplingParams(temperature=1.0, max_tokens=8, seed=i))
            for i, p in enumerate(prompts)]
    before = dict(sampler.counters())
    got = gen_many(sampler, reqs)
    d = {k: sampler.counters()[k] - before[k] for k in before}
    assert (d["prefill_tokens"], d["shared_tokens"]) == (21 + 5 * 1 + 21, 5 * 20)
    assert d["cached_tokens"] == 5 * 20
    assert sorted(r.cached_tokens for r in got) == [0, 0] + [20] * 5
    alone = _sampler(model, share_prefix=False)
    try:
        want = gen_many(alone, reqs)
        assert (alone.stats.prefill_tokens, alone.stats.shared_tokens) == (7 * 21, 0)
    finally:
        alone.close()
    for a, b in zip(want, got):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, rtol=0, atol=1e-5)


def test_continuous_batching_grows_and_compacts(sampler):
    """Rows join a running batch, the cache grows and compacts, results stay exact."""
    long = [(prompt_of(60 + i, 3 + i % 3), GREEDY.replace(max_tokens=28 - i)) for i in range(6)]
    short = [(prompt_of(70 + i, 6 + i), GREEDY.replace(max_tokens=8 - i)) for i in range(5)]
    solo = [gen(sampler, p, sp) for p, sp in long + short]
    resizes = sampler.stats.resizes

    async def join_running_batch():
        first = [asyncio.ensure_future(sampler.generate(p, sp)) for p, sp in long]
        chunks = sampler.stats.decode_chunks
        while sampler.stats.decode_chunks == chunks:
            await asyncio.sleep(0.0005)
        rest = [asyncio.ensure_future(sampler.generate(p, sp)) for p, sp in short]
        return await asyncio.gather(*first, *rest)

    got = run(join_running_batch())
    assert sampler.stats.resizes >= resizes + 2  # grew to 16 rows, compacted back to 8
    for a, b in zip(solo, got):
        assert a.output_ids == b.output_ids
        np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-5)


def test_the_cache_shrinks_when_the_running_rows_need_half_of_it(model):
    """A decode step reads every cache slot, so a cache grown for one long request
    is cut back once the running rows need at most half of it. A free row keeps
    the part of its prefix that still fits (the rest is counted), and results
    stay exact."""
    s = _sampler(model, max_context=64, min_cache_len=16, max_batch=8)
    try:
        first = prompt_of(1, 10)
        long = gen(s, first, GREEDY.replace(max_tokens=40))  # needs 49 slots: 64
        assert ("decode_chunk", 8, 64, 4) in s.stats.shapes
        assert s.stats.cache_shrinks == 0
        short = gen(s, prompt_of(2, 4), GREEDY.replace(max_tokens=8))  # needs 11: 16
        assert ("resize_cache", 8, 64, 8, 16) in s.stats.shapes
        assert s.stats.cache_shrinks == 1
        # The long request's row held 49 tokens of history; 16 fit.
        assert s.stats.prefix_tokens_dropped == 49 - 16
        turn2 = first + long.output_ids + [5, 6]
        r = gen(s, turn2, GREEDY.replace(max_tokens=8))
        assert r.cached_tokens == 16
        ((lg, lps),) = learner(model, [turn2 + r.output_ids])
        np.testing.assert_allclose(r.output_logprobs, lps[len(turn2) - 1:-1], atol=1e-4)
        np.testing.assert_array_equal(np.argmax(lg[len(turn2) - 1:-1], -1), r.output_ids)
        ((_, lps),) = learner(model, [prompt_of(2, 4) + short.output_ids])
        np.testing.assert_allclose(short.output_logprobs, lps[3:-1], atol=1e-4)
    finally:
        s.close()
    keep = _sampler(model, max_context=64, min_cache_len=16, max_batch=8, shrink_cache=False)
    try:  # shrink_cache=False: the long prefix stays whole
        assert gen(keep, first, GREEDY.replace(max_tokens=40)).output_ids == long.output_ids
        gen(keep, prompt_of(2, 4), GREEDY.replace(max_tokens=8))
        assert keep.stats.cache_shrinks == 0
        assert gen(keep, turn2, GREEDY.replace(max_tokens=8)).cached_tokens == 49
    finally:
        keep.close()


def test_context_limits_and_errors(sampler):
    with pytest.raises(ContextLengthError):
        gen(sampler, list(range(1, CTX + 1)))
    with pytest.raises(ContextLengthError):
        gen(sampler, list(range(1, CTX)) + [1])
    with pytest.raises(ValueError, match="empty"):
        gen(sampler, [])
    with pytest.raises(ValueError, match="vocabulary"):
        gen(sampler, [1, 2, 256])
    with pytest.raises(ValueError, match="top_logprobs"):
        gen(sampler, [1, 2], SamplingParams(top_logprobs=5))
    r = gen(sampler, list(range(1, CTX - 2)), GREEDY.replace(max_tokens=10))
    assert r.finish_reason == "length" and len(r.output_ids) == 3  # context is full
    assert gen(sampler, [1, 2, 3]).finish_reason == "length"  # the loop survived


def test_cancelled_call_frees_its_row(sampler):
    async def go():
        t = asyncio.ensure_future(sampler.generate(prompt_of(70), GREEDY.replace(max_tokens=50)))
        await asyncio.sleep(0)  # submitted, not finished (a timed sleep raced a fast machine)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        return await sampler.generate(prompt_of(71), GREEDY)
    assert len(run(go()).output_ids) == GREEDY.max_tokens


class GatedBytes:
    """Byte-level decode that blocks its first call until released: it pauses
    the sampler's worker between two decode chunks of a running request."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def decode(self, ids):
        self.entered.set()
        assert self.release.wait(timeout=60)
        return bytes(ids).decode("latin-1")


def test_load_weights_swaps_between_results(tmp_path):
    model, gate = _model(0), GatedBytes()
    p, sp = prompt_of(80), GREEDY.replace(max_tokens=20)
    with _sampler(model, publish_dir=str(tmp_path), tokenizer=gate) as s:
        with pytest.raises(FileNotFoundError):
            s.load_weights()  # nothing published yet
        old = gen(s, p, sp)
        publish_weights(_model(1), str(tmp_path), 7)

        async def swap_mid_generation():
            # The stop string never matches; checking it pauses the worker mid-request.
            inflight = asyncio.ensure_future(s.generate(p, sp.replace(stop=("\xff\xfe\xfd",))))
            await asyncio.to_thread(gate.entered.wait, 60)
            step = await asyncio.to_thread(s.load_weights)
            after = asyncio.ensure_future(s.generate(p, sp))
            await asyncio.sleep(0.01)
            gate.release.set()
            return await inflight, step, await after

        inflight, step, new = run(swap_mid_generation())
        assert step == 7 and s.policy_version == 7 and s.stats.weight_swaps == 1
        assert inflight.policy_version == 0 and inflight.output_ids == old.output_ids
        np.testing.assert_allclose(inflight.output_logprobs, old.output_logprobs, atol=1e-5)
        assert new.policy_version == 7 and new.output_ids != old.output_ids
    with _sampler(_model(1)) as ref:
        want = gen(ref, p, sp)
    assert new.output_ids == want.output_ids
    np.testing.assert_allclose(new.output_logprobs, want.output_logprobs, atol=1e-5)


def test_set_weights_swaps_like_load_weights(model):
    p, sp = prompt_of(40), GREEDY.replace(max_tokens=8)
    with _sampler(_model(0)) as s:
        assert s.set_weights(_model(1), 5) == 5 and s.policy_version == 5
        seen = []  # read in the worker thread, while this request's tokens arrive
        new = run(s.generate(p, sp, on_tokens=lambda ids, lps: seen.append(s.running_version)))
        assert new.policy_version == 5 and seen and set(seen) == {5}
        with pytest.raises(ValueError, match="shape"):
            s.set_weights(Decoder(CONFIG.replace(intermediate_size=32), rngs=nnx.Rngs(0)), 6)
        with pytest.raises(ValueError, match="other parameters"):
            s.set_weights(Decoder(CONFIG.replace(num_layers=1), rngs=nnx.Rngs(0)), 6)
        assert s.policy_version == 5
    with _sampler(_model(1)) as ref:
        want = gen(ref, p, sp)
    assert new.output_ids == want.output_ids
    np.testing.assert_allclose(new.output_logprobs, want.output_logprobs, atol=1e-5)


def test_close_fails_new_calls(model):
    s = _sampler(model)
    assert s.probe() == {"policy_version": 0}
    s.close()
    with pytest.raises(SamplerUnavailable, match="closed"):  # never queued: safe to resend
        gen(s, [1, 2, 3])
    with pytest.raises(SamplerError, match="closed"):
        s.probe()


# ---------------------------------------------------------------- issue 13: under fire


def _forced(params, **fields):
    """`params` with fields set past validation (a caller that bypassed SamplingParams)."""
    for k, v in fields.items():
        object.__setattr__(params, k, v)
    return params


def _same(a, b):
    assert a.output_ids == b.output_ids and a.finish_reason == b.finish_reason
    np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-5, rtol=0)


BAD = [  # (prompt, params, field named in the error)
    ([1, 2, 3], lambda: _forced(SamplingParams(), top_k=2**40), "top_k"),
    ([1, 2, 3], lambda: _forced(SamplingParams(), temperature=float("nan")), "temperature"),
    ([1, 2, 3], lambda: _forced(SamplingParams(), seed=2**80), "seed"),
    ([1, 2, 3], lambda: _forced(SamplingParams(), max_tokens=True), "max_tokens"),
    ([1, 2, 3], lambda: SamplingParams(top_logprobs=5), "top_logprobs"),
    ([1, 2, 3], lambda: SamplingParams(stop_token_ids=(256,)), "stop_token_ids"),
    ([1, "2", 3], lambda: GREEDY, "prompt_ids"),
    ([1, True, 3], lambda: GREEDY, "prompt_ids"),
    ([1, 2.5, 3], lambda: GREEDY, "prompt_ids"),
    ("abc", lambda: GREEDY, "prompt_ids"),
]


def test_poisoned_batch_bad_requests_fail_alone(sampler):
    """8 good requests in flight beside bad ones: each bad one raises ValueError naming
    its field in the caller; the 8 complete exactly as they do alone."""
    good = [(prompt_of(90 + i, 4 + i), SamplingParams(temperature=0.8, top_k=10,
                                                      max_tokens=16 + i % 3, seed=i))
            for i in range(8)]
    solo = [gen(sampler, p, sp) for p, sp in good]
    errors, restarts = sampler.stats.request_errors, sampler.stats.worker_restarts

    async def go():
        tasks = [asyncio.ensure_future(sampler.generate(p, sp)) for p, sp in good]
        chunks = sampler.stats.decode_chunks
        while sampler.stats.decode_chunks == chunks:  # the good ones are decoding
            await asyncio.sleep(0.0005)
        bad = []
        for prompt, params, field in BAD:
            # Parameters are named as SamplingParams.<field> (the endpoint's 400 `param`).
            name = field if field == "prompt_ids" else f"SamplingParams.{field}"
            with pytest.raises(ValueError, match=name):
                await sampler.generate(prompt, params())
            bad.append(field)
        assert not all(t.done() for t in tasks)  # still in flight while rejected
        return bad, await asyncio.gather(*tasks)

    bad, got = run(go())
    assert len(bad) == len(BAD)
    for a, b in zip(solo, got):
        _same(a, b)
    assert sampler.stats.request_errors == errors and sampler.stats.worker_restarts == restarts
    with pytest.raises(TypeError, match="on_tokens"):
        run(sampler.generate([1, 2], GREEDY, on_tokens=5))


class _BackendCompiles:
    """Counts XLA backend compiles in this process while active."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.n = 0

    def _on(self, event, duration, **kw):
        if event == self.EVENT:
            self.n += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._on)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._on)


def _varied_load(s, rounds=3):
    """Requests of many prompt lengths, batch sizes, stops and top-logprobs."""
    rng = np.random.default_rng(0)
    for r in range(rounds):
        reqs = []
        for i in range(int(rng.integers(1, 21))):
            n = int(rng.integers(2, CTX - 4))
            p = SamplingParams(temperature=float(rng.choice([0.0, 1.0])), max_tokens=4,
                               seed=i, top_logprobs=int(rng.integers(0, 3)),
                               stop_token_ids=tuple(int(t) for t in rng.integers(0, 256, r)))
            reqs.append((prompt_of(100 * r + i, n), p))
        for res in gen_many(s, reqs):
            assert res.output_ids


# The warm-up tests' rows: 1-20 concurrent requests then queue for 4 rows, and a warm-up
# compiles every shape of 3 row buckets (1, 2, 4), not 5 (to 16): the same claims, a third
# of the programs.
WARM_ROWS = 4


def test_fixed_shapes_after_warmup_compile_nothing(model):
    """fixed_shapes + warmup(): varied traffic (1-20 concurrent requests, prompt
    lengths 2-27, stop ids, top-logprobs, greedy and sampled) adds no shape and
    no XLA compile. Bucketed shapes under the same traffic keep adding both."""
    s = _sampler(model, fixed_shapes=True, min_batch=1, min_cache_len=1, max_batch=WARM_ROWS)
    try:
        known = s.warmup()
        assert known == s.stats.compiled_shapes > 2
        with _BackendCompiles() as c:
            _varied_load(s)
        assert s.stats.compiled_shapes == known
        assert c.n == 0, f"{c.n} XLA compiles after warmup"
    finally:
        s.close()
    b = _sampler(model, min_batch=1, min_cache_len=8, min_prefill_rows=1, max_batch=WARM_ROWS)
    try:
        gen(b, prompt_of(0, 3))
        first = b.stats.compiled_shapes
        with _BackendCompiles() as c:
            _varied_load(b)
        # (Fewer compiles than new shapes: jit caches are per process, and the
        # fixed sampler above already compiled some of these shapes.)
        assert b.stats.compiled_shapes > first and c.n > 0
    finally:
        b.close()


def test_fixed_cache_length_with_bucketed_rows_after_warmup_compiles_nothing(model):
    """min_cache_len = max_context, rows bucketed 1..4: warmup() compiles every row
    bucket's shapes; the same varied traffic (rows growing and shrinking between
    buckets) then adds no shape and no XLA compile, and uses more than one row
    bucket."""
    s = _sampler(model, min_batch=1, min_prefill_rows=1, max_batch=WARM_ROWS)  # cache: CTX
    try:
        known = s.warmup()
        decode_buckets = {k[1] for k in s.stats.shapes if k[0] == "decode_chunk"}
        assert decode_buckets == {1, 2, 4}
        with _BackendCompiles() as c:
            _varied_load(s)
        assert s.stats.compiled_shapes == known
        assert c.n == 0, f"{c.n} XLA compiles after warmup"
        assert s.stats.resizes > 0  # the load moved between row buckets
    finally:
        s.close()


def test_warmup_needs_a_fixed_cache_length(model):
    s = _sampler(model, min_cache_len=8)
    try:
        with pytest.raises(ValueError, match="fixed cache length"):
            s.warmup()
    finally:
        s.close()


# ----------------------------------------------------------------- LoRA adapters


def _adapted(base, seed, **lora_kw):
    """`base` plus one random adapter (A and B drawn: a fresh B is zero)."""
    from ac2_jax.models.lora import LoRAConfig
    lora = LoRAConfig(**{"rank": 4, "alpha": 8.0, **lora_kw})
    m = Decoder(CONFIG.replace(lora=lora), rngs=nnx.Rngs(seed))
    nnx.update(m, nnx.state(base, nnx.Not(nnx.LoRAParam)))
    state = nnx.state(m, nnx.LoRAParam)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    nnx.update(m, jax.tree.unflatten(tree, [0.3 * jax.random.normal(k, x.shape)
                                            for k, x in zip(keys, leaves, strict=True)]))
    return m


def test_two_adapters_interleaved_in_one_batch_each_give_their_own_outputs(model):
    """A bank sampler serves the base and two adapters (different ranks and
    targets) to requests interleaved in one batch: each request's greedy tokens
    and log-probs are those of its own model (a plain sampler of it, and the
    learner's forward within 1e-5). Writing an adapter compiles nothing."""
    from ac2_jax.models.lora import LoRAConfig
    a = _adapted(model, 1)
    b = _adapted(model, 2, rank=2, targets=("q", "v", "down"), rslora=True)
    bank = Decoder(CONFIG.replace(lora=LoRAConfig(rank=4, slots=4)), rngs=nnx.Rngs(0))
    nnx.update(bank, nnx.state(model, nnx.Param))
    prompts = [prompt_of(i) for i in range(6)]
    names = ["a", "b", None, "b", "a", None]
    refs = {}
    for name, m in (("a", a), ("b", b), (None, model)):
        with _sampler(m) as plain:
            refs[name] = gen_many(plain, [(p, GREEDY) for p in prompts])
    with _sampler(bank, weight_swap="in_flight") as s:
        assert s.adapters() == []
        with pytest.raises(ValueError, match="adapter"):
            gen(s, prompts[0], GREEDY.replace(adapter="a"))
        assert s.add_adapter("a", a) == 1 and s.add_adapter("b", b) == 2
        assert s.adapters() == ["a", "b"]
        got = gen_many(s, [(p, GREEDY.replace(adapter=n)) for p, n in zip(prompts, names)])
        assert s.stats.max_active >= 6  # one batch
        shapes = s.stats.compiled_shapes
        replaced = []  # replace: same shapes, nothing compiles

        def replace_a(ids, lps):  # the worker thread, after the first chunk
            if not replaced:
                replaced.append(s.add_adapter("a", b))

        # Even in flight an adapter change waits for the running rows: the policy
        # version stays, so no token could record that its weights changed.
        spanning = run(s.generate(prompts[0], GREEDY.replace(adapter="a"), on_tokens=replace_a))
        again = gen(s, prompts[0], GREEDY.replace(adapter="a"))
        assert replaced and s.stats.in_flight_swaps == 0
        assert s.stats.compiled_shapes == shapes
        s.remove_adapter("b")
        with pytest.raises(ValueError, match="serves no adapter 'b'"):
            gen(s, prompts[0], GREEDY.replace(adapter="b"))
    for i, (n, r) in enumerate(zip(names, got)):
        ref = refs[n][i]
        assert r.output_ids == ref.output_ids, (i, n)
        np.testing.assert_allclose(r.output_logprobs, ref.output_logprobs, atol=1e-5)
    assert spanning.output_ids == refs["a"][0].output_ids and spanning.output_versions is None
    np.testing.assert_allclose(spanning.output_logprobs, refs["a"][0].output_logprobs, atol=1e-5)
    assert again.output_ids == refs["b"][0].output_ids
    # the learner's forward of each adapter's own model gives the same log-probs
    for i in (0, 1):
        m = {"a": a, "b": b}[names[i]]
        seq = prompts[i] + got[i].output_ids
        (_, lps), = learner(m, [seq])
        np.testing.assert_allclose(lps[len(prompts[i]) - 1:-1], got[i].output_logprobs,
                                   atol=1e-5)
    assert refs["a"][0].output_ids != refs[None][0].output_ids  # the adapters matter


# ---- In-flight weight updates (`JaxSampler(weight_swap="in_flight")`, issue 65) ------------
# A long generation spans two weight updates. Every output token records the version that
# sampled it, and its log-prob equals one forward pass of that version's weights over the
# whole prefix (fp32, 1e-4): the KV rule is recompute (the running row's prefix is
# prefilled again under the new weights). The versions and log-probs reach the RL batch:
# the loss's behaviour log-probs input (`SAMPLER_LOGPROBS`) is the recorded one, the
# `POLICY_VERSION` feature is the per-token version, and staleness is judged per token.
# The sampler has this module's geometry (`_sampler`): its shapes are already compiled.

PROMPT = [5, 17, 29, 41, 53, 65]
LONG = SamplingParams(temperature=1.0, top_k=40, max_tokens=24, seed=3)  # 6 + 24 <= CTX
SHORT = SamplingParams(temperature=0.8, max_tokens=4, seed=4)
SWAP_AT = {8: 1, 16: 2}  # output tokens seen -> the version set_weights puts in


@pytest.fixture(scope="module")
def versions(model):
    """The weights of versions 0, 1, 2."""
    return [model, _model(1), _model(2)]


@pytest.fixture(scope="module")
def spanned(versions):
    """(long result, short result, sampler stats): the long generation's on_tokens
    (the worker thread, between chunks) publishes versions 1 and 2."""
    s = _sampler(_model(0), weight_swap="in_flight")  # set_weights writes into its model
    seen = []

    def on_tokens(ids, lps):
        seen.extend(ids)
        for at, v in SWAP_AT.items():
            if len(seen) >= at and s.policy_version < v:
                s.set_weights(versions[v], v)

    async def go():
        return await asyncio.gather(s.generate(PROMPT, LONG, on_tokens=on_tokens),
                                    s.generate(PROMPT[:4], SHORT))

    with s:
        long, short = run(go())
    return long, short, s.stats


def test_in_flight_every_token_is_its_versions_forward_pass(spanned, versions):
    long, short, stats = spanned
    v_of = np.asarray(long.token_versions())
    assert len(long.output_ids) == LONG.max_tokens and long.policy_version == 0
    assert long.output_versions is not None and set(v_of) == {0, 1, 2}
    assert np.all(np.diff(v_of) >= 0)  # swapped between chunks, never back
    ids, lps = np.asarray(long.output_ids), np.asarray(long.output_logprobs)
    for v, m in enumerate(versions):  # one full forward pass per version, no cache
        ((lg, _),) = learner(m, [PROMPT + long.output_ids])
        want = np.asarray(ref_logprobs(lg[len(PROMPT) - 1:-1], ids, temperature=LONG.temperature,
                                       top_k=LONG.top_k, top_p=LONG.top_p))
        at = v_of == v
        np.testing.assert_allclose(lps[at], want[at], atol=1e-4, rtol=0)
        if v:  # the tokens of other versions are not this one's (the check can fail)
            assert np.abs(lps[~at] - want[~at]).max() > 1e-2
    assert stats.in_flight_swaps == 2 and stats.weight_swaps == 2
    assert stats.recomputed_tokens >= len(PROMPT) + 8  # the prefix, again, per swap
    assert short.output_versions is None and short.policy_version == 0


def test_in_flight_recompute_shares_a_groups_prompt(versions):
    """An in-flight swap recomputes a group's shared 20-token prompt once (one row
    computes it, the other copies it) and each token is still its version's forward."""
    s = _sampler(_model(0), weight_swap="in_flight")
    prompt = [(13 * j + 2) % 256 for j in range(20)]
    params = [LONG.replace(max_tokens=10, seed=i) for i in range(2)]

    def on_tokens(ids, lps):
        if s.policy_version == 0:
            s.set_weights(versions[1], 1)

    async def go():
        return await asyncio.gather(s.generate(prompt, params[0], on_tokens=on_tokens),
                                    s.generate(prompt, params[1]))

    with s:
        got = run(go())
    assert s.stats.in_flight_swaps == 1 and s.stats.shared_tokens >= 19 + 19
    for r, sp in zip(got, params, strict=True):
        v_of = np.asarray(r.token_versions())
        assert set(v_of) == {0, 1}
        for v in (0, 1):
            ((lg, _),) = learner(versions[v], [prompt + r.output_ids])
            want = np.asarray(ref_logprobs(lg[len(prompt) - 1:-1], np.asarray(r.output_ids),
                                           temperature=sp.temperature, top_k=sp.top_k,
                                           top_p=sp.top_p))
            at = v_of == v
            np.testing.assert_allclose(np.asarray(r.output_logprobs)[at], want[at], atol=1e-4)


def test_in_flight_the_rl_batch_carries_per_token_versions_and_logprobs(spanned, versions):
    from ac2_jax.segments import POLICY_VERSION, SAMPLER_LOGPROBS
    from ac2_jax.trace.recorder import TraceRecorder
    from ac2_jax.trace.types import Completion, Trace
    from ac2_jax.training.core.objectives import behaviour_logprobs
    from ac2_jax.training.rl import BatchConfig, build_batch
    from ac2_jax.training.rl.metrics import batch_metrics

    long = spanned[0]
    v_of = np.asarray(long.token_versions())
    trace = Trace(task_id="t", reward=1.0, status="finished")
    TraceRecorder(trace).record("main", Completion(
        PROMPT, long.output_ids, long.output_logprobs, policy_version=long.policy_version,
        temperature=LONG.temperature, top_k=LONG.top_k, top_p=LONG.top_p,
        output_versions=long.output_versions))
    assert Trace.from_dict(trace.to_dict()).episodes[0].completions[0].output_versions == (
        long.output_versions)
    # Per-trace staleness (the default): lag 2 is within max_staleness=2, all trains.
    batch, stats, _ = build_batch([trace], 2, BatchConfig(seq_len=64, rows=1, max_staleness=2))
    m = batch.loss_mask > 0
    assert m.sum() == len(long.output_ids)
    np.testing.assert_array_equal(batch.feature(POLICY_VERSION)[m], v_of)
    np.testing.assert_allclose(batch.feature(SAMPLER_LOGPROBS)[m], long.output_logprobs, atol=0)
    assert stats.token_lags == {2 - v: int((v_of == v).sum()) for v in (0, 1, 2)}
    metrics = batch_metrics(stats)
    assert [metrics[f"staleness_tokens/{k}"] for k in (0, 1, 2)] == [
        float((v_of == v).sum()) for v in (2, 1, 0)]
    # The PG loss's behaviour input against a learner at version 2: its ratio is 1
    # on version 2's tokens and not on version 0's (the recorded log-probs are theirs).
    seq = PROMPT + long.output_ids
    np.testing.assert_array_equal(batch.tokens[0, :len(seq)], seq)  # the row's only segment
    ((lg, _),) = learner(versions[2], [seq])
    logits = np.zeros((*batch.tokens.shape, lg.shape[-1]), np.float32)
    logits[0, :len(seq)] = lg
    logp = np.asarray(jax.jit(behaviour_logprobs)(logits, batch))[m]
    sampler = batch.feature(SAMPLER_LOGPROBS)[m]
    np.testing.assert_allclose(logp[v_of == 2], sampler[v_of == 2], atol=1e-4)
    assert np.abs(logp[v_of == 0] - sampler[v_of == 0]).max() > 1e-2
    # Per token: with max_staleness=1 the version-0 tokens leave the loss, counted; the
    # rest trains (per trace, the whole trace would be dropped).
    cfg = BatchConfig(seq_len=64, rows=1, max_staleness=1, stale_unit="token")
    batch, stats, _ = build_batch([trace], 2, cfg)
    m = batch.loss_mask > 0
    assert stats.dropped_stale_tokens == int((v_of == 0).sum()) and stats.dropped_stale == 0
    np.testing.assert_array_equal(batch.feature(POLICY_VERSION)[m], v_of[v_of > 0])
    assert build_batch([trace], 2, BatchConfig(seq_len=64, rows=1, max_staleness=1))[0] is None
    with pytest.raises(ValueError, match="stale_unit='token'.*stale='drop'"):
        BatchConfig(stale_unit="token", stale="downweight")


def test_weight_swap_is_a_config_choice_checked_by_name(model):
    from ac2_jax.sampling import SamplerConfig, SamplerSetup, build_sampler
    from ac2_jax.sampling.remote.sglang import SGLangSampler
    from ac2_jax.serving.server import sampler_config

    with pytest.raises(ValueError, match="weight_swap must be one of"):
        JaxSampler(model, max_context=CTX, weight_swap="inflight")
    with pytest.raises(ValueError, match="sampler.weight_swap must be one of"):
        SamplerConfig(weight_swap="inflight")
    with pytest.raises(ValueError, match="weight_swap='in_flight' is not offered"):
        SGLangSampler("http://127.0.0.1:9", max_context=CTX, weight_swap="in_flight")
    cfg = SamplerConfig(weight_swap="in_flight", warmup=False)
    with build_sampler(cfg, SamplerSetup(model=model, tokenizer=None, max_context=CTX)) as s:
        assert s.weight_swap == "in_flight"
    # The endpoint's flag (python -m ac2_jax.serving --weight_swap=...) reaches it.
    assert sampler_config("jax", weight_swap="in_flight").weight_swap == "in_flight"
    assert sampler_config("jax").weight_swap == "drain"
    with pytest.raises(ValueError, match="--weight_swap has no effect with --sampler=sglang"):
        sampler_config("sglang", sglang_url="http://127.0.0.1:9", weight_swap="in_flight")
