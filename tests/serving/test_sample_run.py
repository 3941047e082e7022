"""serving/sample_run.py: one request's sampling tasks (Generation) and SSE framing."""

import asyncio
import json

import pytest
from flax import nnx

from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.sampling import SamplingParams
from ac2_jax.sampling.jax_sampler import JaxSampler
from ac2_jax.serving.sample_run import Generation, sse
from ac2_jax.serving.streaming import TokenFeed

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def sampler():
    model = Decoder(DecoderConfig.tiny(vocab_size=256, initializer_range=0.5), rngs=nnx.Rngs(0))
    s = JaxSampler(model, max_context=32, max_batch=8, min_batch=8, min_cache_len=32,
                   steps_per_sync=4, seed=0, prefill_chunk=16, min_prefill_rows=8)
    yield s
    s.close()


def test_sse_frames_one_json_event_keeping_unicode():
    frame = sse({"text": "café", "n": 1})
    assert frame.startswith("data: ") and frame.endswith("\n\n")
    assert json.loads(frame[len("data: "):]) == {"text": "café", "n": 1}
    assert "café" in frame  # not \\u-escaped


def test_generation_runs_n_tasks_and_feeds_their_tokens(sampler):
    async def go():
        feed = TokenFeed()
        gen = Generation(sampler, [1, 2, 3], [GREEDY, GREEDY], feed)
        results = await gen.results()
        fed: dict[int, list[int]] = {0: [], 1: []}
        done = set()
        while not feed.queue.empty():
            item = feed.queue.get_nowait()
            if item[0] == "tokens":
                fed[item[1]].extend(item[2])
            else:
                done.add(item[1])
        return results, fed, done

    results, fed, done = asyncio.run(go())
    assert len(results) == 2 and results[0].output_ids == results[1].output_ids  # greedy
    assert done == {0, 1}
    for i, r in enumerate(results):
        assert fed[i] == list(r.output_ids)  # every sampled token went out, in order


def test_a_cancelled_generation_cancels_every_task(sampler):
    async def go():
        gen = Generation(sampler, [1, 2, 3], [GREEDY, GREEDY], None)
        gen.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gen.results()
        return gen

    gen = asyncio.run(go())
    assert all(t.cancelled() for t in gen.tasks)
