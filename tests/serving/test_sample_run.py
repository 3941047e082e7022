"""serving/core/sample_run.py: one request's sampling tasks (Generation) and SSE framing."""

import asyncio
import json

import pytest
from flax import nnx

from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.sampling import SamplingParams
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.serving.core.sample_run import Generation, sse
from ac2_jax.serving.core.streaming import TokenFeed

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


def test_the_endpoint_records_a_moe_samplers_routing_in_the_trace(tmp_path):
    """A MoE policy served by the endpoint: each completion of the rollout's trace
    carries the experts its tokens were routed to (prompt + output), so the learner
    can replay them; routing that does not cover its completion is dropped and
    counted (`routing_of`)."""
    import httpx
    import openai

    from ac2_jax.models.family import build_model
    from ac2_jax.models.moe import MoEDecoderConfig
    from ac2_jax.sampling import SampleResult
    from ac2_jax.serving.app import build_app
    from ac2_jax.serving.core.sample_run import routing_of
    from ac2_jax.serving.server import serve_in_thread
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
    from ac2_jax.trace import TraceStore, decode_routing, encode_routing

    tok = build_tiny_tokenizer(str(tmp_path / "tok"))
    cfg = MoEDecoderConfig.tiny(vocab_size=tok.vocab_size, num_layers=2, scan_layers=False,
                                remat="none", max_position_embeddings=128)
    store = TraceStore(str(tmp_path / "traces.jsonl"))
    admin = {"Authorization": "Bearer sk-a"}
    with JaxSampler(build_model(cfg, nnx.Rngs(0)), max_context=128, max_batch=2,
                    min_batch=2, min_cache_len=128, tokenizer=tok, seed=0,
                    eos_token_ids=tok.stop_token_ids) as sampler:
        url, stop = serve_in_thread(build_app(sampler, tok, admin_key="sk-a", model_name="m",
                                              trace_store=store))
        try:
            info = httpx.post(url + "/v1/rollouts", headers=admin, json={"task_id": "t"}).json()
            client = openai.OpenAI(base_url=info["base_url"], api_key=info["api_key"],
                                   max_retries=0, timeout=120)
            client.chat.completions.create(model="m", max_tokens=6, messages=[
                {"role": "user", "content": "hello"}])
            httpx.post(f"{url}/v1/rollouts/{info['rollout_id']}/finish", headers=admin,
                       json={"reward": 1.0})
        finally:
            stop()
    (trace,) = store.read()
    (comp,) = [c for ep in trace.episodes for c in ep.completions]
    ids = decode_routing(comp.routed_experts)
    assert ids.shape[0] == len(comp.prompt_ids) + len(comp.output_ids)
    assert trace.metrics.get("routing_not_recorded", 0) == 0
    short = SampleResult([1, 2], [0.0, 0.0], "stop", 0, routed_experts=encode_routing(ids[:3]))
    assert routing_of(short, 5) is None and routing_of(short, 1) is not None
