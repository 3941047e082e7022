"""JaxSampler's worker (ac2_jax.sampling.engine.worker): streaming to on_tokens,
cancellation, and failures that stay with their own request (a row's host
work, an injected device fault, a request forced past the checks).

Uses test_jax_sampler's tiny model, sampler settings and helpers (same
shapes, so the compiles are shared when both files run in one process).
"""

import asyncio
import threading

import numpy as np
import pytest

from ac2_jax.sampling import SamplerError, SamplingParams
from tests.sampling.test_jax_sampler import (  # noqa: F401
    GREEDY,
    _same,
    _sampler,
    gen,
    model,
    prompt_of,
    run,
    sampler,
)


def test_on_tokens_streams_exactly_the_output(sampler):
    calls, seen = [], []
    p, sp = prompt_of(100), SamplingParams(temperature=1.0, max_tokens=24, seed=7)

    async def go():
        task = None

        def on_tokens(ids, lps):
            calls.append((list(ids), list(lps)))
            seen.append((threading.current_thread().name, task.done()))

        task = asyncio.ensure_future(sampler.generate(p, sp, on_tokens=on_tokens))
        return await task

    r = run(go())
    assert len(calls) >= 3  # 24 tokens at 4 steps per device call, streamed per call
    assert [t for ids, _ in calls for t in ids] == r.output_ids
    assert [x for _, lps in calls for x in lps] == r.output_logprobs  # exact
    assert seen == [("JaxSampler", False)] * len(calls)  # the worker, before the result
    _same(r, gen(sampler, p, sp))  # streaming changes nothing


def test_on_tokens_after_stop_token_and_stop_string(model, sampler):
    class ByteTokenizer:
        def decode(self, ids):
            return bytes(ids).decode("latin-1")

    p = prompt_of(101)
    full = gen(sampler, p, GREEDY.replace(max_tokens=20)).output_ids
    k = next(i for i in range(8, 20) if full[i] not in full[:i])
    for sp in (GREEDY.replace(max_tokens=20, stop_token_ids=(full[k],)),
               GREEDY.replace(max_tokens=20, stop=(ByteTokenizer().decode(full[k - 1:k + 1]),))):
        calls = []
        with _sampler(model, tokenizer=ByteTokenizer()) as s:
            r = run(s.generate(p, sp, on_tokens=lambda ids, lps: calls.append(ids)))
        assert r.finish_reason == "stop" and r.output_ids == full[:k + 1]
        assert len(calls) >= 2 and [t for c in calls for t in c] == r.output_ids


class Gate:
    """Blocks the sampler's worker inside a callback until the test releases it."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def wait(self):
        self.entered.set()
        assert self.release.wait(timeout=60)


def test_cancel_mid_generation_frees_the_row(sampler):
    gate, streamed = Gate(), []
    p, sp = prompt_of(110, 5), GREEDY.replace(max_tokens=24)
    other = (prompt_of(111, 7), SamplingParams(temperature=1.0, max_tokens=20, seed=3))
    want = gen(sampler, *other)
    cancelled = sampler.stats.cancelled

    def on_tokens(ids, lps):
        streamed.extend(ids)
        if not gate.entered.is_set():
            gate.wait()  # the worker pauses after the first chunk of this request

    async def go():
        t = asyncio.ensure_future(sampler.generate(p, sp, on_tokens=on_tokens))
        o = asyncio.ensure_future(sampler.generate(*other))
        await asyncio.to_thread(gate.entered.wait, 60)
        t.cancel()  # the client went away mid-generation
        with pytest.raises(asyncio.CancelledError):
            await t
        gate.release.set()
        got = await o
        while sampler.stats.cancelled == cancelled:  # freed at the next chunk boundary
            await asyncio.sleep(0.001)
        return got

    _same(run(go()), want)
    assert sampler.stats.cancelled == cancelled + 1
    assert 0 < len(streamed) < sp.max_tokens  # stopped mid-way, nothing after the cancel
    # The freed row is reused: its slots still hold the cancelled prompt + streamed tokens.
    nxt = gen(sampler, p + streamed[:2] + [9])
    assert nxt.cached_tokens == len(p) + 2  # all but its last token (fed by decode)
    assert len(nxt.output_ids) == GREEDY.max_tokens


def test_error_in_one_rows_host_work_fails_that_request_only(model, sampler):
    reqs = [(prompt_of(120 + i, 5), GREEDY.replace(max_tokens=10 + i)) for i in range(4)]
    solo = [gen(sampler, p, sp) for p, sp in reqs]
    errors = sampler.stats.request_errors

    def broken(ids, lps):
        raise KeyError("client hung up")

    async def go(s, calls):
        return await asyncio.gather(*[s.generate(p, sp, on_tokens=cb) for p, sp, cb in calls],
                                    return_exceptions=True)

    got = run(go(sampler, [(p, sp, broken if i == 1 else None) for i, (p, sp) in enumerate(reqs)]))
    assert isinstance(got[1], SamplerError) and isinstance(got[1].__cause__, KeyError)
    for i in (0, 2, 3):
        _same(got[i], solo[i])
    assert sampler.stats.request_errors == errors + 1

    class FailingTokenizer:  # decode is only needed by the request with stop strings
        def decode(self, ids):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")

    with _sampler(model, tokenizer=FailingTokenizer()) as s:
        got = run(go(s, [(p, sp.replace(stop=("x",)) if i == 2 else sp, None)
                         for i, (p, sp) in enumerate(reqs)]))
        assert isinstance(got[2], SamplerError) and "UnicodeDecodeError" in str(got[2])
        for i in (0, 1, 3):
            _same(got[i], solo[i])
        assert s.stats.request_errors == 1 and s.stats.worker_restarts == 0
        _same(gen(s, *reqs[0]), solo[0])  # its row was freed; the sampler goes on


def test_worker_crash_fails_only_what_it_held(sampler, monkeypatch):
    """An exception escaping a device call: the requests in rows fail with SamplerError,
    queued ones survive and complete exactly; the worker restarts with a fresh cache."""
    from ac2_jax.sampling.engine import worker as mod

    first = [(prompt_of(130 + i, 4 + i % 4), GREEDY.replace(max_tokens=8 + i % 5))
             for i in range(18)]  # more than max_batch=16: some wait for a row
    late = [(prompt_of(150 + i, 6), SamplingParams(temperature=1.0, max_tokens=12, seed=i))
            for i in range(3)]
    solo = [gen(sampler, p, sp) for p, sp in first + late]
    errors, restarts = sampler.stats.request_errors, sampler.stats.worker_restarts
    gate, held, real = Gate(), [], mod.decode_chunk

    def faulty(graphdef, state, cache, rows, *a, **kw):
        if held:
            return real(graphdef, state, cache, rows, *a, **kw)
        held.append(int(np.asarray(rows.active).sum()))
        gate.wait()
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(mod, "decode_chunk", faulty)

    async def go():
        tasks = [asyncio.ensure_future(sampler.generate(p, sp)) for p, sp in first]
        await asyncio.to_thread(gate.entered.wait, 60)
        # Queued while the worker is inside the failing device call: never admitted before it.
        tasks += [asyncio.ensure_future(sampler.generate(p, sp)) for p, sp in late]
        await asyncio.sleep(0)
        gate.release.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    got = run(go())
    failed = [g for g in got if isinstance(g, Exception)]
    assert len(failed) == held[0] >= 1
    for g in failed:
        assert isinstance(g, SamplerError) and "injected device fault" in str(g)
    for g, want in zip(got, solo):
        if not isinstance(g, Exception):
            _same(g, want)
    for g, want in zip(got[len(first):], solo[len(first):]):
        _same(g, want)  # the late ones all survived
    assert sampler.stats.worker_restarts == restarts + 1
    assert sampler.stats.request_errors == errors + held[0]
    _same(gen(sampler, *first[0]), solo[0])


def test_request_forced_past_the_checks_fails_alone_at_admission(sampler):
    """Defence in depth: params changed after admission checks (top_k=2**40) fail that
    request when the worker takes it; the running request is untouched."""
    gate = Gate()
    p, sp = prompt_of(160, 5), GREEDY.replace(max_tokens=16)
    want = gen(sampler, p, sp)
    errors = sampler.stats.request_errors

    def on_tokens(ids, lps):
        if not gate.entered.is_set():
            gate.wait()

    async def go():
        t = asyncio.ensure_future(sampler.generate(p, sp, on_tokens=on_tokens))
        await asyncio.to_thread(gate.entered.wait, 60)  # the worker is paused mid-request
        req = sampler._make_request([1, 2, 3], SamplingParams(temperature=1.0))
        object.__setattr__(req.params, "top_k", 2**40)
        gate.release.set()
        with pytest.raises(SamplerError, match="OverflowError"):
            await asyncio.wrap_future(req.future)
        return await t

    _same(run(go()), want)
    assert sampler.stats.request_errors == errors + 1


def test_close_fails_running_and_queued_requests_with_sampler_error(model):
    gate = Gate()

    def on_tokens(ids, lps):
        if not gate.entered.is_set():
            gate.wait()

    s = _sampler(model)

    async def go():
        running = asyncio.ensure_future(s.generate(prompt_of(170), GREEDY.replace(max_tokens=20),
                                                   on_tokens=on_tokens))
        await asyncio.to_thread(gate.entered.wait, 60)
        queued = asyncio.ensure_future(s.generate(prompt_of(171), GREEDY))
        await asyncio.sleep(0)
        closing = asyncio.ensure_future(asyncio.to_thread(s.close))
        while True:  # close() has queued its stop (flag and queue change under one lock)
            with s._lock:
                if s._closed:
                    break
            await asyncio.sleep(0.001)
        gate.release.set()
        await closing
        return await asyncio.gather(running, queued, return_exceptions=True)

    for r in run(go()):
        assert isinstance(r, SamplerError) and "closed" in str(r)
    with pytest.raises(SamplerError, match="closed"):
        gen(s, [1, 2, 3])
