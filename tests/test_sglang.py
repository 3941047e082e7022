"""SGLangSampler against a local server speaking SGLang's native JSON.

SGLang itself needs CUDA, so the server here is a FastAPI app on 127.0.0.1
that answers /generate and /update_weights_from_disk with the shapes SGLang
documents, computing with a real tiny Decoder (through the JaxSampler) and
loading weights from the HF safetensors directory it is pointed at.
"""

import asyncio
import os
import threading

import numpy as np
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from flax import nnx

from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.models.hf_io import load_hf_checkpoint
from ac2_jax.models.tokenizer import build_tiny_tokenizer
from ac2_jax.sampling import ContextLengthError, SamplingParams
from ac2_jax.sampling.jax_sampler import JaxSampler
from ac2_jax.sampling.sglang import SGLangError, SGLangSampler, parse_generate_response
from ac2_jax.serving.app import build_app
from ac2_jax.serving.server import serve_in_thread
from serving_helpers import forward_logprobs

MAX_CONTEXT = 128


class FakeSGLang:
    """The SGLang HTTP surface over a JaxSampler; logs every request body."""

    def __init__(self, model, tok):
        self.tok = tok
        self.model = model
        self.sampler = JaxSampler(model, max_context=MAX_CONTEXT, tokenizer=tok, max_batch=4)
        self.version = "default"
        self.log: list[tuple[str, dict]] = []
        self.update_started = threading.Event()
        self.release_update = threading.Event()
        self.release_update.set()
        self.app = FastAPI()
        self.app.post("/generate")(self.generate)
        self.app.post("/update_weights_from_disk")(self.update)

    async def generate(self, body: dict):
        self.log.append(("generate", body))
        sp = body["sampling_params"]
        params = SamplingParams(
            temperature=sp["temperature"], top_p=sp["top_p"], top_k=sp["top_k"],
            max_tokens=sp["max_new_tokens"], stop=sp.get("stop", ()),
            stop_token_ids=sp.get("stop_token_ids", ()), seed=sp.get("sampling_seed"),
            top_logprobs=body.get("top_logprobs_num", 0))
        r = await self.sampler.generate(body["input_ids"], params)
        finish = ({"type": "stop", "matched": r.output_ids[-1]} if r.finish_reason == "stop"
                  else {"type": "length", "length": len(r.output_ids)})
        meta = {"id": "abc", "finish_reason": finish, "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(r.output_ids), "cached_tokens": r.cached_tokens,
                "weight_version": self.version,
                "output_token_logprobs": [[lp, t, None] for t, lp in
                                          zip(r.output_ids, r.output_logprobs)]}
        if r.top_logprobs is not None:
            meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in row]
                                           for row in r.top_logprobs]
        return {"text": self.tok.decode(r.output_ids), "output_ids": r.output_ids,
                "meta_info": meta}

    def update(self, body: dict):
        self.log.append(("update_start", body))
        self.update_started.set()
        self.release_update.wait()
        path = body["model_path"]
        if not os.path.exists(os.path.join(path, "config.json")):
            self.log.append(("update_end", body))
            return JSONResponse({"success": False, "message": f"no model at {path}",
                                 "num_paused_requests": 0}, status_code=400)
        model, config = load_hf_checkpoint(path)
        shape = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim")
        if any(getattr(config, f) != getattr(self.model.config, f) for f in shape):
            self.log.append(("update_end", body))
            return JSONResponse({"success": False, "message": "config of the new weights does "
                                 "not match the served model", "num_paused_requests": 0},
                                status_code=400)
        old, self.sampler = self.sampler, JaxSampler(model, max_context=MAX_CONTEXT,
                                                     tokenizer=self.tok, max_batch=4)
        old.close()
        self.model, self.version = model, body.get("weight_version") or self.version
        self.log.append(("update_end", body))
        return {"success": True, "message": "Succeeded to update model weights.",
                "num_paused_requests": 0}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def tiny_model(tok, seed):
    return Decoder(DecoderConfig.tiny(vocab_size=tok.vocab_size, max_position_embeddings=256),
                   rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def server(tok):
    fake = FakeSGLang(tiny_model(tok, 0), tok)
    url, stop = serve_in_thread(fake.app)
    yield fake, url
    stop()
    fake.sampler.close()


def run(coro):
    return asyncio.run(coro)


def test_top_k_and_top_p_are_refused_before_any_request(server, tok):
    """SGLang's log-probs come before its top-k/top-p filters: not behaviour log-probs."""
    fake, url = server
    s = SGLangSampler(url, max_context=MAX_CONTEXT, vocab_size=tok.vocab_size)
    n = len(fake.log)
    for params in (SamplingParams(top_k=20), SamplingParams(top_p=0.9)):
        with pytest.raises(ValueError, match="top_k=-1 and top_p=1"):
            run(s.generate(tok.encode("hi"), params))
    assert len(fake.log) == n  # nothing reached the server


def test_generate_sends_native_json_and_reads_logprobs(server, tok):
    fake, url = server
    s = SGLangSampler(url, max_context=MAX_CONTEXT, vocab_size=tok.vocab_size)
    prompt = tok.encode("What is 3 + 4?")
    params = SamplingParams(temperature=0.0, max_tokens=6, stop=["zzz"],
                            stop_token_ids=list(tok.stop_token_ids), seed=7, top_logprobs=2)
    r = run(s.generate(prompt, params))
    kind, body = fake.log[-1]
    assert kind == "generate" and body["input_ids"] == prompt and body["return_logprob"] is True
    sp = body["sampling_params"]
    assert sp["temperature"] == 0.0 and sp["top_p"] == 1.0 and sp["top_k"] == -1
    assert sp["max_new_tokens"] == 6 and sp["stop"] == ["zzz"] and sp["sampling_seed"] == 7
    assert sp["stop_token_ids"] == list(tok.stop_token_ids) and body["top_logprobs_num"] == 2
    assert 1 <= len(r.output_ids) <= 6 and r.finish_reason in ("stop", "length")
    ref = forward_logprobs(fake.model, prompt + r.output_ids)[len(prompt):]
    np.testing.assert_allclose(r.output_logprobs, ref, atol=1e-4)
    assert all(len(row) == 2 and row[0][0] == t for row, t in zip(r.top_logprobs, r.output_ids))
    assert r.policy_version == 0  # the server's "default" version is not a number


def test_context_is_checked_and_max_tokens_clamped(server, tok):
    _, url = server
    s = SGLangSampler(url, max_context=MAX_CONTEXT)
    with pytest.raises(ContextLengthError):
        run(s.generate([1] * MAX_CONTEXT, SamplingParams()))
    assert s.request_body([1] * (MAX_CONTEXT - 3), SamplingParams(max_tokens=50))[
        "sampling_params"]["max_new_tokens"] == 3


def test_server_errors_are_reported(server, tok):
    _, url = server
    with pytest.raises(SGLangError, match="HTTP 404"):
        run(SGLangSampler(url + "/v2", max_context=MAX_CONTEXT).generate([1], SamplingParams()))
    with pytest.raises(SGLangError, match="failed"):
        run(SGLangSampler("http://127.0.0.1:9", max_context=8).generate([1], SamplingParams()))
    with pytest.raises(SGLangError, match="output_token_logprobs"):
        parse_generate_response({"text": "x", "meta_info": {}}, 0)
    with pytest.raises(SGLangError, match="abort"):
        parse_generate_response({"meta_info": {"finish_reason": {"type": "abort"},
                                               "output_token_logprobs": []}}, 0)
    r = parse_generate_response({"meta_info": {
        "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 3, "x"]],
        "weight_version": "12", "cached_tokens": 4}}, 0)
    assert (r.output_ids, r.policy_version, r.cached_tokens) == ([3], 12, 4)


def test_load_weights_exports_and_hot_swaps(server, tok, tmp_path):
    from ac2_jax.models.params_io import publish_weights
    fake, url = server
    publish_dir, export_dir = str(tmp_path / "publish"), str(tmp_path / "export")
    new = tiny_model(tok, 1)
    publish_weights(new, publish_dir, 3)
    s = SGLangSampler(url, max_context=MAX_CONTEXT, model=tiny_model(tok, 2),
                      publish_dir=publish_dir, export_dir=export_dir, keep_exports=1)
    assert s.load_weights() == 3 and s.policy_version == 3
    kind, body = [e for e in fake.log if e[0] == "update_end"][-1]
    assert body == {"model_path": os.path.join(export_dir, "step_3"), "weight_version": "3"}
    assert sorted(os.listdir(body["model_path"])) == ["config.json", "model.safetensors"]
    prompt = tok.encode("hello there")
    r = run(s.generate(prompt, SamplingParams(temperature=0, max_tokens=4)))
    assert r.policy_version == 3
    ref = forward_logprobs(new, prompt + r.output_ids)[len(prompt):]
    np.testing.assert_allclose(r.output_logprobs, ref, atol=1e-4)

    publish_weights(tiny_model(tok, 0), publish_dir, 4)
    assert s.load_weights(4) == 4
    assert os.listdir(export_dir) == ["step_4"]  # keep_exports=1


def test_generate_waits_for_a_running_update(server, tok, tmp_path):
    from ac2_jax.models.params_io import publish_weights
    fake, url = server
    publish_dir = str(tmp_path / "publish")
    publish_weights(tiny_model(tok, 5), publish_dir, 5)
    s = SGLangSampler(url, max_context=MAX_CONTEXT, model=tiny_model(tok, 2),
                      publish_dir=publish_dir, export_dir=str(tmp_path / "export"))
    fake.update_started.clear()
    fake.release_update.clear()
    loader = threading.Thread(target=s.load_weights)
    loader.start()
    assert fake.update_started.wait(60)

    async def during_update():
        task = asyncio.create_task(s.generate([1, 2, 3], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0.3)
        assert not task.done()
        fake.release_update.set()
        return await task

    r = run(during_update())
    loader.join()
    kinds = [k for k, _ in fake.log]
    assert kinds[-3:] == ["update_start", "update_end", "generate"]
    assert r.policy_version == 5


def test_failed_update_keeps_the_version(server, tok, tmp_path):
    from ac2_jax.models.params_io import publish_weights
    fake, url = server
    publish_dir = str(tmp_path / "publish")
    # Weights of another architecture: the server refuses them, as SGLang would.
    other = Decoder(DecoderConfig.tiny(vocab_size=tok.vocab_size + 8,
                                       max_position_embeddings=256), rngs=nnx.Rngs(0))
    publish_weights(other, publish_dir, 9)
    s = SGLangSampler(url, max_context=MAX_CONTEXT, model=other, publish_dir=publish_dir,
                      export_dir=str(tmp_path / "export"), policy_version=1)
    with pytest.raises(SGLangError, match="HTTP 400.*does not match"):
        s.load_weights()
    assert s.policy_version == 1
    with pytest.raises(ValueError, match="needs model"):
        SGLangSampler(url, max_context=8).load_weights()


def test_endpoint_serves_through_sglang(server, tok):
    _, url = server
    s = SGLangSampler(url, max_context=MAX_CONTEXT, vocab_size=tok.vocab_size)
    api, stop = serve_in_thread(build_app(s, tok, admin_key="admin", model_name="tiny"))
    try:
        client = openai.OpenAI(base_url=api + "/v1", api_key="admin", max_retries=0)
        resp = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
            temperature=0, logprobs=True)
        assert resp.choices[0].finish_reason in ("stop", "length")
        assert len(resp.choices[0].logprobs.content) == resp.usage.completion_tokens
    finally:
        stop()
