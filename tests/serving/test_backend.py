"""serving/backend: a JaxSampler behind SGLang's native HTTP API, driven by the
unchanged `SGLangSampler` client (and raw HTTP for SGLang's error shapes), in
this process over real HTTP. Log-probs are checked against a forward pass of
the served weights in fp32, atol 1e-4."""

import asyncio
import json

import httpx
import numpy as np
import pytest
from flax import nnx

from ac2_jax.models import Decoder, DecoderConfig, publish_weights
from ac2_jax.sampling import JaxSampler, SamplingParams
from ac2_jax.sampling.remote.sglang import SGLangSampler
from ac2_jax.serving.backend import build_backend_app
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from tests.support.serving_helpers import forward_logprobs

CONTEXT = 128


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def tiny(tok, seed):
    return Decoder(DecoderConfig.tiny(vocab_size=tok.vocab_size, max_position_embeddings=256),
                   rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def backend(tok):
    """(url, served model, sampler, app) of one backend on 127.0.0.1."""
    model = tiny(tok, 0)
    sampler = JaxSampler(model, max_context=CONTEXT, max_batch=4, steps_per_sync=2,
                         eos_token_ids=tok.stop_token_ids, tokenizer=tok)
    app = build_backend_app(sampler, tok, model_path="tiny")
    url, stop = serve_in_thread(app)
    yield url, model, sampler, app
    stop()
    sampler.close()


def client(url, tok, tmp_path, version=0):
    return SGLangSampler(url, max_context=CONTEXT, model=tiny(tok, 9),
                         publish_dir=str(tmp_path / "publish"), export_dir=str(tmp_path / "export"),
                         vocab_size=tok.vocab_size, policy_version=version)


def test_the_sglang_client_samples_from_it_plain_and_streamed(backend, tok, tmp_path):
    url, model, _, _ = backend
    s = client(url, tok, tmp_path)
    prompt = tok.encode("hello there, agent")
    chunks = []

    async def go():
        plain = await s.generate(prompt, SamplingParams(temperature=1.0, max_tokens=6, seed=7))
        streamed = await s.generate(prompt, SamplingParams(temperature=1.0, max_tokens=6, seed=7),
                                    on_tokens=lambda i, lp: chunks.append((i, lp)))
        await s.aclose()
        return plain, streamed

    plain, streamed = asyncio.run(go())
    # The same seed samples the same tokens, streamed or not; the streamed
    # pieces add up to the result; log-probs are the served model's (T=1).
    assert streamed.output_ids == plain.output_ids and len(plain.output_ids) >= 1
    assert [t for ids, _ in chunks for t in ids] == streamed.output_ids
    assert [x for _, lps in chunks for x in lps] == streamed.output_logprobs
    ref = forward_logprobs(model, prompt + plain.output_ids)[len(prompt):]
    np.testing.assert_allclose(plain.output_logprobs, ref, atol=1e-4)
    assert plain.policy_version == streamed.policy_version == 0
    assert s.max_context == CONTEXT - 1  # SGLang's strict check, read from /v1/models


def test_weight_update_through_the_client_hot_swaps_the_backend(backend, tok, tmp_path):
    url, _, sampler, app = backend
    new = tiny(tok, 5)
    publish_weights(new, str(tmp_path / "publish"), 3)
    s = client(url, tok, tmp_path, version=sampler.policy_version)
    assert s.load_weights(3) == 3
    info = httpx.get(url + "/get_model_info").json()
    assert info["weight_version"] == "3" and info["model_path"].endswith("step_3")
    prompt = tok.encode("after the update")

    async def go():
        r = await s.generate(prompt, SamplingParams(temperature=0, max_tokens=5))
        streamed = await s.generate(prompt, SamplingParams(temperature=0, max_tokens=5),
                                    on_tokens=lambda ids, lps: None)
        await s.aclose()
        return r, streamed

    r, streamed = asyncio.run(go())
    # Both report version 3 (streamed: in its first chunk, before any token).
    assert r.policy_version == streamed.policy_version == 3
    assert streamed.output_ids == r.output_ids
    ref = forward_logprobs(new, prompt + r.output_ids)[len(prompt):]
    np.testing.assert_allclose(r.output_logprobs, ref, atol=1e-4)
    assert app.state.counts["weight_updates"] >= 1


def test_sglang_error_shapes(backend, tok):
    url = backend[0]
    with httpx.Client(base_url=url) as http:
        r = http.post("/generate", json={"input_ids": [1] * CONTEXT,
                                         "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400 and "longer than the model's context length" in r.text
        r = http.post("/generate", json={"input_ids": [1, 2], "sampling_params":
                                         {"max_new_tokens": CONTEXT - 2}})
        assert r.status_code == 400 and "maximum context length" in r.text
        r = http.post("/generate", json={"input_ids": [10**6], "sampling_params": {}})
        assert r.status_code == 400 and "vocabulary" in r.text
        r = http.post("/generate", json={"input_ids": [1, 2],
                                         "sampling_params": {"temperature": -1}})
        assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
        r = http.post("/generate", json={"input_ids": "not ids"})
        assert r.status_code == 400 and r.json()["object"] == "error"
        # Streamed: the refusal comes in-band, then [DONE].
        r = http.post("/generate", json={"input_ids": [1] * CONTEXT, "stream": True,
                                         "sampling_params": {"max_new_tokens": 1}})
        lines = [x for x in r.text.splitlines() if x.startswith("data:")]
        assert "context length" in json.loads(lines[0][5:])["error"]["message"]
        assert lines[-1] == "data: [DONE]"
        # Weight updates need an integer version and an HF directory.
        r = http.post("/update_weights_from_disk", json={"model_path": "/nowhere"})
        assert r.status_code == 400 and "weight_version must be an integer" in r.text
        r = http.post("/update_weights_from_disk", json={"model_path": "/nowhere",
                                                          "weight_version": "4"})
        assert r.status_code == 400 and "config.json" in r.json()["message"]
        assert http.get("/get_model_info").json()["weight_version"] != "4"


def test_a_checkpoint_of_another_model_is_refused_and_nothing_changes(backend, tok, tmp_path):
    from ac2_jax.models import save_hf_checkpoint
    url, _, sampler, _ = backend
    other = Decoder(DecoderConfig.tiny(vocab_size=tok.vocab_size, num_layers=1,
                                       max_position_embeddings=256), rngs=nnx.Rngs(0))
    save_hf_checkpoint(other, str(tmp_path / "other"))
    before = sampler.policy_version
    r = httpx.post(url + "/update_weights_from_disk",
                   json={"model_path": str(tmp_path / "other"), "weight_version": "11"})
    assert r.status_code == 400 and "other parameters" in r.json()["message"]
    assert sampler.policy_version == before
    assert httpx.get(url + "/get_model_info").json()["weight_version"] == str(before)


def test_a_client_that_leaves_a_stream_cancels_its_request(backend, tok):
    url, _, sampler, app = backend
    counts = app.state.counts
    before = counts["cancelled"]

    async def go():
        async with httpx.AsyncClient(base_url=url) as http:
            async with http.stream("POST", "/generate", json={
                    "input_ids": tok.encode("a long one"), "stream": True,
                    "sampling_params": {"max_new_tokens": 100, "temperature": 1.0}}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        break  # leave after the first chunk

    # The server thread shares this process (and its GIL) with the client: on a slow
    # or busy machine it can sample all 100 tokens (or a stop token) and write the whole
    # stream into the socket buffers before the client's break closes the connection,
    # and that request then finishes, as it should. So up to 3 tries; each must end
    # cancelled or finished (nothing left in flight), and one must be cancelled.
    for _ in range(3):
        finished = counts["finished"]
        asyncio.run(go())
        for _ in range(200):
            if counts["in_flight"] == 0 and (
                counts["cancelled"] > before or counts["finished"] > finished
            ):
                break
            asyncio.run(asyncio.sleep(0.02))
        assert counts["in_flight"] == 0
        assert counts["cancelled"] + counts["finished"] == before + finished + 1
        if counts["cancelled"] == before + 1:
            break
    assert counts["cancelled"] == before + 1


def test_an_in_flight_sampler_is_refused_by_name(backend, tok):
    """SGLang's /generate answers one weight_version per answer: a JaxSampler that
    swaps weights in flight would lose its per-token versions behind it, so it is
    refused (it was served, every token reported as the first one's version)."""
    s = JaxSampler(backend[1], max_context=CONTEXT, weight_swap="in_flight")
    with s, pytest.raises(ValueError, match="weight_swap='in_flight'.*'drain'"):
        build_backend_app(s, tok)
