"""In-flight weight updates (`JaxSampler(weight_swap="in_flight")`, issue 65).

A long generation spans two weight updates. Every output token records the
version that sampled it, and its log-prob equals one forward pass of that
version's weights over the whole prefix (fp32, 1e-4): the KV rule is
recompute (the running row's prefix is prefilled again under the new
weights). The versions and log-probs reach the RL batch: the loss's
behaviour log-probs input (`SAMPLER_LOGPROBS`) is the recorded one, the
`POLICY_VERSION` feature is the per-token version, and staleness is judged
per token.
"""

import asyncio

import jax
import numpy as np
import pytest
from flax import nnx

from ac2_jax.losses import token_logprobs
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.sampling import SamplingParams
from ac2_jax.sampling.jax_sampler import JaxSampler
from ac2_jax.segments import POLICY_VERSION, SAMPLER_LOGPROBS
from ac2_jax.trace.recorder import TraceRecorder
from ac2_jax.trace.types import Completion, Trace
from ac2_jax.training.rl import BatchConfig, build_batch
from ac2_jax.training.rl.metrics import batch_metrics

CTX = 64
CONFIG = DecoderConfig.tiny(vocab_size=256, initializer_range=0.5)
PROMPT = [5, 17, 29, 41, 53, 65]
LONG = SamplingParams(temperature=1.0, top_k=40, max_tokens=36, seed=3)
SHORT = SamplingParams(temperature=0.8, max_tokens=4, seed=4)
SWAP_AT = {8: 1, 20: 2}  # output tokens seen -> the version set_weights puts in


def _model(seed):
    return Decoder(CONFIG, rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def models():
    return [_model(s) for s in (0, 1, 2)]


@pytest.fixture(scope="module")
def spanned(models):
    """(long result, short result, sampler stats): the long generation's
    on_tokens (the worker thread, between chunks) publishes versions 1 and 2."""
    s = JaxSampler(_model(0), max_context=CTX, max_batch=2, min_batch=2, min_cache_len=CTX,
                   steps_per_sync=4, prefill_chunk=16, seed=0, weight_swap="in_flight")
    seen = []

    def on_tokens(ids, lps):
        seen.extend(ids)
        for at, v in SWAP_AT.items():
            if len(seen) >= at and s.policy_version < v:
                s.set_weights(models[v], v)

    async def go():
        return await asyncio.gather(s.generate(PROMPT, LONG, on_tokens=on_tokens),
                                    s.generate(PROMPT[:4], SHORT))

    with s:
        long, short = asyncio.run(go())
    return long, short, s.stats


@jax.jit
def _logits(graphdef, state, tokens):
    n = tokens.shape[1]
    return nnx.merge(graphdef, state)(tokens, np.arange(n)[None], np.ones((1, n), np.int32))[0]


def test_every_token_is_its_versions_forward_pass(spanned, models):
    long, short, stats = spanned
    versions = np.asarray(long.token_versions())
    assert len(long.output_ids) == LONG.max_tokens and long.policy_version == 0
    assert long.output_versions is not None and set(versions) == {0, 1, 2}
    assert np.all(np.diff(versions) >= 0)  # swapped between chunks, never back
    seq = np.asarray([PROMPT + long.output_ids], np.int32)
    ids = np.asarray(long.output_ids)
    for v, m in enumerate(models):  # one full forward pass per version, no cache
        lg = np.asarray(_logits(*nnx.split(m), seq))[len(PROMPT) - 1:-1]
        want = np.asarray(token_logprobs(lg, ids, temperature=LONG.temperature,
                                         top_k=LONG.top_k, top_p=LONG.top_p))
        at = versions == v
        np.testing.assert_allclose(np.asarray(long.output_logprobs)[at], want[at],
                                   atol=1e-4, rtol=0)
        if v:  # the tokens of other versions are not this one's (the check can fail)
            assert np.abs(np.asarray(long.output_logprobs)[~at] - want[~at]).max() > 1e-2
    assert stats.in_flight_swaps == 2 and stats.weight_swaps == 2
    assert stats.recomputed_tokens >= len(PROMPT) + 8  # the prefix, again, per swap
    assert short.output_versions is None and short.policy_version == 0


def _trace(long):
    trace = Trace(task_id="t", reward=1.0, status="finished")
    TraceRecorder(trace).record("main", Completion(
        PROMPT, long.output_ids, long.output_logprobs, policy_version=long.policy_version,
        temperature=LONG.temperature, top_k=LONG.top_k, top_p=LONG.top_p,
        output_versions=long.output_versions))
    return trace


def test_the_rl_batch_carries_per_token_versions_and_logprobs(spanned, models):
    long = spanned[0]
    versions = np.asarray(long.token_versions())
    trace = _trace(long)
    assert Trace.from_dict(trace.to_dict()).episodes[0].completions[0].output_versions == (
        long.output_versions)
    # Per-trace staleness (the default): lag 2 is within max_staleness=2, all trains.
    batch, stats, _ = build_batch([trace], 2, BatchConfig(seq_len=64, rows=1, max_staleness=2))
    m = batch.loss_mask > 0
    assert m.sum() == len(long.output_ids)
    np.testing.assert_array_equal(batch.feature(POLICY_VERSION)[m], versions)
    np.testing.assert_allclose(batch.feature(SAMPLER_LOGPROBS)[m], long.output_logprobs,
                               atol=0)
    assert stats.token_lags == {2 - v: int((versions == v).sum()) for v in (0, 1, 2)}
    metrics = batch_metrics(stats)
    assert [metrics[f"staleness_tokens/{k}"] for k in (0, 1, 2)] == [
        float((versions == v).sum()) for v in (2, 1, 0)]
    # The PG loss's behaviour input against a learner at version 2: its ratio is 1
    # on version 2's tokens and not on version 0's (the recorded log-probs are theirs).
    from ac2_jax.training.core.objectives import behaviour_logprobs
    from ac2_jax.training.core.train_step import forward
    logits = jax.jit(forward, static_argnums=0)(*nnx.split(models[2], nnx.Param, ...), batch)
    logp = np.asarray(behaviour_logprobs(logits, batch))[m]
    sampler = batch.feature(SAMPLER_LOGPROBS)[m]
    np.testing.assert_allclose(logp[versions == 2], sampler[versions == 2], atol=1e-4)
    assert np.abs(logp[versions == 0] - sampler[versions == 0]).max() > 1e-2
    # Per token: with max_staleness=1 the version-0 tokens leave the loss, counted; the
    # rest trains (per trace, the whole trace would be dropped).
    cfg = BatchConfig(seq_len=64, rows=1, max_staleness=1, stale_unit="token")
    batch, stats, _ = build_batch([trace], 2, cfg)
    m = batch.loss_mask > 0
    assert stats.dropped_stale_tokens == int((versions == 0).sum()) and stats.dropped_stale == 0
    np.testing.assert_array_equal(batch.feature(POLICY_VERSION)[m], versions[versions > 0])
    assert build_batch([trace], 2, BatchConfig(seq_len=64, rows=1, max_staleness=1))[0] is None
    with pytest.raises(ValueError, match="stale_unit='token'.*stale='drop'"):
        BatchConfig(stale_unit="token", stale="downweight")


def test_weight_swap_is_a_config_choice_checked_by_name(models):
    from ac2_jax.sampling import SamplerConfig, SamplerSetup, build_sampler
    from ac2_jax.sampling.sglang import SGLangSampler

    with pytest.raises(ValueError, match="weight_swap must be one of"):
        JaxSampler(models[0], max_context=CTX, weight_swap="inflight")
    with pytest.raises(ValueError, match="sampler.weight_swap must be one of"):
        SamplerConfig(weight_swap="inflight")
    with pytest.raises(ValueError, match="weight_swap='in_flight' is not offered"):
        SGLangSampler("http://127.0.0.1:9", max_context=CTX, weight_swap="in_flight")
    cfg = SamplerConfig(weight_swap="in_flight", warmup=False)
    s = build_sampler(cfg, SamplerSetup(model=_model(0), tokenizer=None, max_context=CTX))
    with s:
        assert s.weight_swap == "in_flight"


def test_the_endpoint_flag_reaches_the_sampler_config():
    from ac2_jax.serving.server import sampler_config

    assert sampler_config("jax", weight_swap="in_flight").weight_swap == "in_flight"
    assert sampler_config("jax").weight_swap == "drain"
    with pytest.raises(ValueError, match="--weight_swap has no effect with --sampler=sglang"):
        sampler_config("sglang", sglang_url="http://127.0.0.1:9", weight_swap="in_flight")
