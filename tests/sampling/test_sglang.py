"""SGLangSampler against `sglang_fake.FakeSGLang`, a local server reproducing
SGLang's documented HTTP behaviour (SGLang itself needs CUDA), over real HTTP.

Log-prob equivalence is checked against a forward pass of the served weights
in fp32, atol 1e-4.
"""

import asyncio
import os
import shutil
import threading

import httpx
import numpy as np
import openai
import pytest
from flax import nnx

from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.sampling import ContextLengthError, SamplerError, SamplingParams
from ac2_jax.sampling.remote.sglang import (
    SGLangError,
    SGLangSampler,
    error_message,
    parse_generate_response,
    request_error,
)
from ac2_jax.serving.app import build_app
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from tests.support.serving_helpers import forward_logprobs
from tests.support.sglang_fake import FakeSGLang

CONTEXT = 128  # the fake's --context-length


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def tiny_model(tok, seed):
    return Decoder(DecoderConfig.tiny(vocab_size=tok.vocab_size, max_position_embeddings=256),
                   rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def base(tok):
    return tiny_model(tok, 0)


@pytest.fixture
def server(tok, base):
    """A fresh fake per test (restarts and knobs do not leak), launched like
    scripts/launch_sglang.sh: --weight-version 0."""
    fake = FakeSGLang(base, tok, context_len=CONTEXT, weight_version="0")
    url, stop = serve_in_thread(fake.app)
    yield fake, url
    stop()
    fake.close()


def run(coro):
    return asyncio.run(coro)


def publish(tok, tmp_path, seed, step):
    """A sampler that has hot-swapped a fresh model (seed) in as `step`; and that model."""
    from ac2_jax.models.io.params_io import publish_weights
    new = tiny_model(tok, seed)
    publish_weights(new, str(tmp_path / "publish"), step)
    return new


def sampler_for(url, tok, tmp_path, **kw):
    return SGLangSampler(url, max_context=CONTEXT, model=tiny_model(tok, 9),
                         publish_dir=str(tmp_path / "publish"),
                         export_dir=str(tmp_path / "export"), vocab_size=tok.vocab_size, **kw)


def test_top_k_and_top_p_are_refused_before_any_request(server, tok):
    """SGLang's log-probs come before its top-k/top-p filters: not behaviour log-probs."""
    fake, url = server
    s = SGLangSampler(url, max_context=CONTEXT, vocab_size=tok.vocab_size)
    for params in (SamplingParams(top_k=20), SamplingParams(top_p=0.9)):
        with pytest.raises(ValueError, match="top_k=-1 and top_p=1"):
            run(s.generate(tok.encode("hi"), params))
    assert fake.log == []  # nothing reached the server


def test_a_grammar_constraint_is_refused_before_any_request(server, tok):
    """SGLang's grammar backends would not apply the masks the learner replays."""
    from ac2_jax.sampling import any_json_grammar
    fake, url = server
    s = SGLangSampler(url, max_context=CONTEXT, vocab_size=tok.vocab_size)
    with pytest.raises(ValueError, match="constraint is not supported by the SGLangSampler"):
        run(s.generate(tok.encode("hi"), SamplingParams(constraint=any_json_grammar())))
    assert fake.log == []  # nothing reached the server


def test_generate_sends_native_json_and_reads_logprobs(server, tok):
    fake, url = server
    s = SGLangSampler(url, max_context=CONTEXT, vocab_size=tok.vocab_size)
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
    assert r.policy_version == 0 and s.stats["probes"] == 1


def test_default_requests_fit_sglangs_context_check(server, tok):
    """SGLang refuses input + max_new_tokens >= context_len: the room is context - 1."""
    fake, url = server
    s = SGLangSampler(url, max_context=CONTEXT, vocab_size=tok.vocab_size)
    assert s.max_context == CONTEXT - 1
    prompt = [5] * (CONTEXT - 4)
    r = run(s.generate(prompt, SamplingParams(max_tokens=10**6, temperature=0)))
    sp = fake.log[-1][1]["sampling_params"]
    assert len(prompt) + sp["max_new_tokens"] == CONTEXT - 1 and len(r.output_ids) >= 1
    n = len(fake.log)
    with pytest.raises(ContextLengthError):  # no room for one output token: never sent
        run(s.generate([5] * (CONTEXT - 1), SamplingParams()))
    assert len(fake.log) == n


def test_endpoint_default_max_tokens_is_not_a_500(server, tok):
    """The endpoint's default max_tokens is the whole room; SGLang must accept it."""
    fake, url = server
    s = SGLangSampler(url, max_context=CONTEXT, vocab_size=tok.vocab_size)
    api, stop = serve_in_thread(build_app(s, tok, admin_key="admin", model_name="tiny"))
    try:
        client = openai.OpenAI(base_url=api + "/v1", api_key="admin", max_retries=0)
        resp = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi " * 10}], temperature=0,
            logprobs=True)
        assert resp.choices[0].finish_reason in ("stop", "length")
        assert len(resp.choices[0].logprobs.content) == resp.usage.completion_tokens
        body = fake.log[-1][1]
        assert len(body["input_ids"]) + body["sampling_params"]["max_new_tokens"] < CONTEXT
    finally:
        stop()


def test_context_length_comes_from_the_server(server, tok):
    """A configured context longer than the server's: the server's max_model_len wins."""
    fake, url = server
    s = SGLangSampler(url, max_context=1024, vocab_size=tok.vocab_size)
    assert s.max_context == 1023  # not probed yet
    assert s.probe()["weight_version"] == "0"
    assert s.max_context == CONTEXT - 1
    with pytest.raises(ContextLengthError):
        run(s.generate([5] * 200, SamplingParams()))
    assert fake.log == []


def test_sglang_400s_pass_through_with_sglangs_message(server, tok):
    fake, url = server
    s = SGLangSampler(url, max_context=CONTEXT)  # no vocab_size: SGLang checks the ids
    bad = [tok.vocab_size + 5, 1]
    with pytest.raises(ValueError, match="HTTP 400.*greater than the vocab size") as e:
        run(s.generate(bad, SamplingParams()))
    assert not isinstance(e.value, SamplerError)
    # The server was relaunched with a shorter --context-length behind our back:
    # SGLang's context 400 is a ContextLengthError, and the next call re-reads it.
    fake.context_len = 32
    with pytest.raises(ContextLengthError, match="longer than the model's context length"):
        run(s.generate([5] * 40, SamplingParams()))
    with pytest.raises(ContextLengthError, match="sampler's context holds 31"):
        run(s.generate([5] * 40, SamplingParams()))
    # SGLang's validation errors (FastAPI 422 turned into 400) have another shape.
    r = httpx.post(url + "/generate", json={"input_ids": "not a list"})
    assert r.status_code == 400 and r.json()["object"] == "error"
    err = request_error(r.status_code, error_message(r), "/generate")
    assert isinstance(err, ValueError) and "input_ids" in str(err)


def test_endpoint_answers_400_for_an_sglang_400(server, tok):
    fake, url = server
    s = SGLangSampler(url, max_context=CONTEXT, vocab_size=tok.vocab_size)
    s.probe()
    fake.context_len = 40  # relaunched with a shorter context; the client has not noticed
    api, stop = serve_in_thread(build_app(s, tok, admin_key="admin", model_name="tiny"))
    try:
        client = openai.OpenAI(base_url=api + "/v1", api_key="admin", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="context length") as e:
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi " * 30}], max_tokens=4)
        assert e.value.status_code == 400
        # The admin sees the client's counters (this used to be a 500: they are a dict).
        r = httpx.get(api + "/v1/models", headers={"Authorization": "Bearer admin"})
        assert r.status_code == 200 and r.json()["data"][0]["sampler_stats"]["probes"] >= 1
    finally:
        stop()
    # The endpoint's loop (and its connection pool) is gone: closing from here
    # drops that pool instead of failing with "Event loop is closed".
    run(s.aclose())


def test_5xx_and_connection_failures_are_sampler_errors(server, tok):
    fake, url = server
    s = SGLangSampler(url, max_context=CONTEXT)
    s.probe()
    fake.fail_with = 503
    with pytest.raises(SGLangError, match="HTTP 503: scheduler is not responding") as e:
        run(s.generate([1, 2], SamplingParams()))
    assert isinstance(e.value, SamplerError)
    with pytest.raises(SGLangError, match="HTTP 404"):
        run(SGLangSampler(url + "/v2", max_context=CONTEXT).generate([1], SamplingParams()))
    with pytest.raises(SGLangError, match="unreachable"):
        run(SGLangSampler("http://127.0.0.1:9", max_context=8).generate([1], SamplingParams()))


def test_parse_generate_response_errors():
    with pytest.raises(SGLangError, match="output_token_logprobs"):
        parse_generate_response({"text": "x", "meta_info": {}}, 0)
    with pytest.raises(SGLangError, match="abort"):
        parse_generate_response({"meta_info": {"finish_reason": {"type": "abort"},
                                               "output_token_logprobs": []}}, 0)
    with pytest.raises(ValueError, match="too long"):
        parse_generate_response({"meta_info": {"output_token_logprobs": [], "finish_reason": {
            "type": "abort", "status_code": 400, "message": "too long"}}}, 0)
    r = parse_generate_response({"meta_info": {
        "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, 3, "x"]],
        "cached_tokens": 4}}, 12)
    assert (r.output_ids, r.policy_version, r.cached_tokens) == ([3], 12, 4)


def test_health_probe(server, tok):
    fake, url = server
    s = SGLangSampler(url, max_context=CONTEXT)
    fake.healthy = False
    with pytest.raises(SGLangError, match="health_generate.*HTTP 503"):
        s.probe()
    with pytest.raises(SamplerError, match="health_generate"):
        run(s.generate([1, 2], SamplingParams(max_tokens=2)))
    assert fake.log == []
    fake.healthy = True
    assert len(run(s.generate([1, 2], SamplingParams(max_tokens=2))).output_ids) >= 1
    assert s.stats["probes"] == 3


def test_load_weights_exports_and_hot_swaps(server, tok, tmp_path):
    fake, url = server
    new = publish(tok, tmp_path, 1, 3)
    s = sampler_for(url, tok, tmp_path, keep_exports=1)
    assert s.load_weights() == 3 and s.policy_version == 3
    kind, body = [e for e in fake.log if e[0] == "update_end"][-1]
    assert body == {"model_path": str(tmp_path / "export" / "step_3"), "weight_version": "3"}
    assert sorted(os.listdir(body["model_path"])) == ["config.json", "model.safetensors"]
    prompt = tok.encode("hello there")
    r = run(s.generate(prompt, SamplingParams(temperature=0, max_tokens=4)))
    assert r.policy_version == 3
    ref = forward_logprobs(new, prompt + r.output_ids)[len(prompt):]
    np.testing.assert_allclose(r.output_logprobs, ref, atol=1e-4)
    publish(tok, tmp_path, 0, 4)
    assert s.load_weights(4) == 4
    assert os.listdir(tmp_path / "export") == ["step_4"]  # keep_exports=1


def test_restart_is_detected_and_the_weights_republished(server, tok, tmp_path):
    """After a restart the server samples with its launch weights and reports
    --weight-version 0: that result is discarded, never stamped 3."""
    fake, url = server
    new = publish(tok, tmp_path, 1, 3)
    s = sampler_for(url, tok, tmp_path)
    s.load_weights(3)
    s.probe()
    fake.restart()
    prompt = tok.encode("hello there")
    got: list = []
    r = run(s.generate(prompt, SamplingParams(temperature=0, max_tokens=6),
                       on_tokens=lambda ids, lps: got.append((ids, lps))))
    assert r.policy_version == 3 and fake.version == "3"
    ref = forward_logprobs(new, prompt + r.output_ids)[len(prompt):]
    np.testing.assert_allclose(r.output_logprobs, ref, atol=1e-4)
    assert [t for ids, _ in got for t in ids] == r.output_ids  # nothing from the base weights
    assert s.stats["restarts"] == 1 and s.stats["republished"] == 1
    assert s.stats["discarded"] == 1
    kinds = [k for k, _ in fake.log if k != "abort"]  # the stale stream may end first
    restart = kinds.index("restart")
    assert kinds[restart:] == ["restart", "generate", "update_start", "update_end", "generate"]
    # Non-streamed calls too.
    fake.restart()
    r = run(s.generate(prompt, SamplingParams(temperature=0, max_tokens=6)))
    ref = forward_logprobs(new, prompt + r.output_ids)[len(prompt):]
    assert r.policy_version == 3 and s.stats["restarts"] == 2
    np.testing.assert_allclose(r.output_logprobs, ref, atol=1e-4)


def test_restart_while_down_then_back(tok, base, tmp_path):
    """The SGLang process dies (connection refused), then comes back on its port."""
    fake = FakeSGLang(base, tok, context_len=CONTEXT, weight_version="0")
    url, stop = serve_in_thread(fake.app)
    port = int(url.rsplit(":", 1)[1])
    new = publish(tok, tmp_path, 1, 3)
    s = sampler_for(url, tok, tmp_path)
    s.load_weights(3)
    stop()
    fake.restart()
    with pytest.raises(SGLangError, match="failed|unreachable"):
        run(s.generate([1, 2, 3], SamplingParams(max_tokens=2)))
    _, stop = serve_in_thread(fake.app, port=port)
    try:
        r = run(s.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=4)))
        ref = forward_logprobs(new, [1, 2, 3] + r.output_ids)[3:]
        np.testing.assert_allclose(r.output_logprobs, ref, atol=1e-4)
        assert r.policy_version == 3 and s.stats["republished"] == 1
    finally:
        stop()
        fake.close()


def test_restart_without_an_export_is_a_loud_sampler_error(server, tok, tmp_path):
    fake, url = server
    publish(tok, tmp_path, 1, 3)
    s = sampler_for(url, tok, tmp_path)
    s.load_weights(3)
    s.probe()
    shutil.rmtree(tmp_path / "export")
    fake.restart()
    with pytest.raises(SamplerError, match="restarted.*weight version '0'.*no export"):
        run(s.generate([1, 2, 3], SamplingParams(max_tokens=2)))
    assert s.policy_version == 3 and s.stats["discarded"] == 1


def test_pool_is_sized_to_max_concurrency(server, tok):
    """150 concurrent calls reach the server at once (httpx's default pool holds 100)."""
    fake, url = server
    s = SGLangSampler(url, max_context=CONTEXT, max_concurrency=150)
    s.probe()
    fake.hold_for = 150

    async def many():
        try:
            return await asyncio.gather(*(s.generate([1, 2], SamplingParams(max_tokens=1))
                                          for _ in range(150)))
        finally:
            await s.aclose()

    results = run(many())
    assert len(results) == 150 and fake.peak_in_flight == 150 and s.stats["waited"] == 0


def test_on_tokens_streams_before_the_result(server, tok):
    fake, url = server
    s = SGLangSampler(url, max_context=CONTEXT, vocab_size=tok.vocab_size)
    prompt = tok.encode("stream me")
    calls: list = []

    async def go():
        task = None

        def on_tokens(ids, lps):
            calls.append((list(ids), list(lps), task.done()))

        task = asyncio.create_task(s.generate(
            prompt, SamplingParams(temperature=1.0, seed=3, max_tokens=12, stop_token_ids=[]),
            on_tokens=on_tokens))
        return await task

    r = run(go())
    assert fake.log[-1][1]["stream"] is True
    assert [t for ids, _, _ in calls for t in ids] == r.output_ids
    assert [x for _, lps, _ in calls for x in lps] == r.output_logprobs
    assert not any(done for _, _, done in calls)  # every call came before the result
    if len(r.output_ids) > 2:
        assert len(calls) > 1  # the fake decodes 2 tokens per step
    ref = forward_logprobs(fake.model, prompt + r.output_ids)[len(prompt):]
    np.testing.assert_allclose(r.output_logprobs, ref, atol=1e-4)


def test_cancel_closes_the_stream_and_sglang_aborts(server, tok):
    fake, url = server
    s = SGLangSampler(url, max_context=CONTEXT)
    s.probe()
    fake.stream_hold = threading.Event()  # the server pauses after the first chunk
    calls: list = []

    async def go():
        first = asyncio.Event()

        def on_tokens(ids, lps):
            calls.append(ids)
            first.set()

        task = asyncio.create_task(s.generate([1, 2, 3], SamplingParams(max_tokens=50),
                                              on_tokens=on_tokens))
        await first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(3000):  # the server notices the disconnect
            if any(k == "abort" for k, _ in fake.log):
                break
            await asyncio.sleep(0.01)
        await s.aclose()

    run(go())
    fake.stream_hold.set()
    assert [k for k, _ in fake.log] == ["generate", "abort"] and len(calls) == 1


def test_stream_errors_and_on_tokens_failures(server, tok):
    fake, url = server
    s = SGLangSampler(url, max_context=CONTEXT)
    s.probe()
    fake.context_len = 16  # SGLang's in-band error chunk
    with pytest.raises(ContextLengthError, match="longer than the model's context length"):
        run(s.generate([5] * 20, SamplingParams(), on_tokens=lambda i, l: None))
    fake.context_len = CONTEXT

    def boom(ids, lps):
        raise RuntimeError("consumer broke")

    async def two():
        return await asyncio.gather(
            s.generate([1, 2], SamplingParams(max_tokens=4), on_tokens=boom),
            s.generate([1, 2], SamplingParams(max_tokens=4), on_tokens=lambda i, l: None),
            return_exceptions=True)

    bad, good = run(two())
    assert isinstance(bad, SamplerError) and "consumer broke" in str(bad)
    assert len(good.output_ids) >= 1


def test_generate_waits_for_a_running_update(server, tok, tmp_path):
    fake, url = server
    publish(tok, tmp_path, 5, 5)
    s = sampler_for(url, tok, tmp_path)
    s.probe()
    fake.update_started.clear()
    fake.release_update.clear()
    loader = threading.Thread(target=s.load_weights)
    loader.start()
    assert fake.update_started.wait(60)

    async def during_update():
        task = asyncio.create_task(s.generate([1, 2, 3], SamplingParams(max_tokens=2)))
        for _ in range(20):
            await asyncio.sleep(0.01)
            assert not task.done()
        fake.release_update.set()
        return await task

    r = run(during_update())
    loader.join()
    kinds = [k for k, _ in fake.log]
    assert kinds[-3:] == ["update_start", "update_end", "generate"]
    assert r.policy_version == 5


def test_failed_update_keeps_the_version(server, tok, tmp_path):
    from ac2_jax.models.io.params_io import publish_weights
    fake, url = server
    publish_dir = str(tmp_path / "publish")
    # Weights of another architecture: the server refuses them, as SGLang would.
    other = Decoder(DecoderConfig.tiny(vocab_size=tok.vocab_size + 8,
                                       max_position_embeddings=256), rngs=nnx.Rngs(0))
    publish_weights(other, publish_dir, 9)
    s = SGLangSampler(url, max_context=CONTEXT, model=other, publish_dir=publish_dir,
                      export_dir=str(tmp_path / "export"), policy_version=1)
    with pytest.raises(SGLangError, match="HTTP 400.*does not match"):
        s.load_weights()
    assert s.policy_version == 1
    with pytest.raises(ValueError, match="needs model"):
        SGLangSampler(url, max_context=8).load_weights()


def test_lora_adapters_load_route_and_refuse_like_sglang(tok, base, tmp_path):
    """load_adapter posts SGLang's /load_lora_adapter with a PEFT directory;
    `SamplingParams.adapter` goes out as `lora_path` and samples that adapter (the
    log-probs of base + adapter's forward); a name the client did not load is
    refused before sending; the server's own 400s (a taken name, a name not
    loaded) come back as ValueError with SGLang's message."""
    import jax

    from ac2_jax.models.io.peft_io import save_peft_adapter
    from ac2_jax.models.lora import LoRAConfig
    cfg = base.config
    bank = Decoder(cfg.replace(lora=LoRAConfig(rank=4, slots=3)), rngs=nnx.Rngs(0))
    nnx.update(bank, nnx.state(base, nnx.Param))
    one = Decoder(cfg.replace(lora=LoRAConfig(rank=2, targets=("q", "v"))), rngs=nnx.Rngs(3))
    nnx.update(one, nnx.state(base, nnx.Not(nnx.LoRAParam)))
    leaves, tree = jax.tree.flatten(nnx.state(one, nnx.LoRAParam))
    nnx.update(one, jax.tree.unflatten(tree, [0.5 * jax.random.normal(jax.random.PRNGKey(i),
                                                                      x.shape)
                                              for i, x in enumerate(leaves)]))
    save_peft_adapter(one, str(tmp_path / "peft"))
    fake = FakeSGLang(bank, tok, context_len=CONTEXT, weight_version="0")
    url, stop = serve_in_thread(fake.app)
    try:
        s = SGLangSampler(url, max_context=CONTEXT, vocab_size=tok.vocab_size)
        params = SamplingParams(temperature=1.0, max_tokens=6, seed=3, adapter="exp1")
        with pytest.raises(ValueError, match="adapter"):
            run(s.generate([5, 6, 7], params))
        assert not [e for e in fake.log if e[0] == "generate"]  # refused before sending
        s.load_adapter("exp1", str(tmp_path / "peft"))
        assert s.adapters() == ["exp1"]
        assert fake.log[-1] == ("load_lora_adapter", {"lora_name": "exp1",
                                                      "lora_path": str(tmp_path / "peft")})
        r = run(s.generate([5, 6, 7], params))
        assert fake.log[-1][1]["lora_path"] == "exp1"
        lps = forward_logprobs(one, [5, 6, 7] + r.output_ids)[3:]
        np.testing.assert_allclose(r.output_logprobs, lps, atol=1e-4)
        with pytest.raises(ValueError, match="already loaded"):
            s.load_adapter("exp1", str(tmp_path / "peft"))
        s.remove_adapter("exp1")
        assert s.adapters() == []
        # the server refuses a name it does not hold, with SGLang's message
        body = s.request_body([5, 6, 7], SamplingParams(max_tokens=4))
        r = httpx.post(url + "/generate", json={**body, "lora_path": "exp1"})
        assert r.status_code == 400
        assert "requested LoRA adapters are not loaded" in r.json()["error"]["message"]
    finally:
        stop()
        fake.close()
