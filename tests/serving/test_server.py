"""serve_in_thread, load_policy and the `python -m ac2_jax.serving` entry point."""

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from fastapi import FastAPI

from ac2_jax.serving.server import load_policy, serve_in_thread
from tests.support.ports import reserved_port


def hello_app():
    app = FastAPI()

    @app.get("/hello")
    async def hello():
        return {"ok": True}

    return app


def test_serve_in_thread_starts_on_a_free_port_and_stops():
    url_a, stop_a = serve_in_thread(hello_app())
    url_b, stop_b = serve_in_thread(hello_app())
    assert url_a != url_b and url_a.startswith("http://127.0.0.1:")
    assert httpx.get(url_a + "/hello").json() == {"ok": True}
    assert httpx.get(url_b + "/hello").json() == {"ok": True}
    stop_a()
    stop_a()  # harmless
    with pytest.raises(httpx.ConnectError):
        httpx.get(url_a + "/hello")
    assert httpx.get(url_b + "/hello").json() == {"ok": True}
    stop_b()


def test_serve_in_thread_reports_a_port_in_use():
    url, stop = serve_in_thread(hello_app())
    try:
        port = int(url.rsplit(":", 1)[1])
        with pytest.raises(RuntimeError, match="failed to start"):
            serve_in_thread(hello_app(), port=port)
    finally:
        stop()


def test_load_policy_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="'tiny' or a local HF directory"):
        load_policy(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="--sglang_url"):
        load_policy("tiny", sampler="sglang")
    with pytest.raises(ValueError, match=r"--sampler: unknown sampler 'vllm': registered are "
                                         r"fleet, jax, sglang"):
        load_policy("tiny", sampler="vllm")
    with pytest.raises(ValueError, match="did you mean 'sglang'"):
        load_policy("tiny", sampler="sglng")
    with pytest.raises(ValueError, match="--sampler=fleet needs --backends"):
        load_policy("tiny", sampler="fleet")
    with pytest.raises(ValueError, match="--sglang_url has no effect with --sampler=jax"):
        load_policy("tiny", sglang_url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="--fixed_shapes has no effect with --sampler=sglang"):
        load_policy("tiny", sampler="sglang", sglang_url="http://127.0.0.1:1", fixed_shapes=True)
    # Nothing silent: the embedded sampler makes no HTTP requests to time out.
    with pytest.raises(ValueError, match="--backend_timeout_s has no effect with --sampler=jax"):
        load_policy("tiny", backend_timeout_s=3.0)


@pytest.mark.full  # the server as a child process
def test_command_line_server(tmp_path):
    port = reserved_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    store = tmp_path / "traces.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ac2_jax.serving", "--model=tiny", f"--port={port}",
         "--admin_key=sk-cli", f"--trace_store={store}", "--max_context=128"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sk-cli"})
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.5)
        assert r.json()["data"][0]["id"] == "tiny" and r.json()["data"][0]["max_model_len"] == 128
        admin = {"Authorization": "Bearer sk-cli"}
        info = httpx.post(url + "/v1/rollouts", json={"task_id": "cli"}, headers=admin).json()
        assert info["base_url"] == url + "/v1"
        with pytest.raises(openai.NotFoundError, match="does not exist"):  # wired, no sampling
            openai.OpenAI(base_url=info["base_url"], api_key=info["api_key"], max_retries=0
                          ).chat.completions.create(model="other", max_tokens=2,
                                                    messages=[{"role": "user", "content": "hi"}])
        httpx.post(url + f"/v1/rollouts/{info['rollout_id']}/finish", json={"reward": 1},
                   headers=admin).raise_for_status()
        assert store.exists() and '"task_id":"cli"' in store.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.full  # the server as a child process
def test_a_restarted_server_serves_the_newest_publish(tmp_path):
    """`python -m ac2_jax.serving --publish_dir=D` started (or restarted) where D holds
    finalized steps serves the newest one, not the launch weights as version 0 (issue 42's
    fault harness: an endpoint restarted after the learner's last publish served version 0
    for good; a collector is still paced by the learner, which tells it learner_step)."""
    from flax import nnx

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.models.io.params_io import publish_weights
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(str(tmp_path / "tok"))
    publish = str(tmp_path / "published")
    for step in (2, 4):
        publish_weights(Decoder(DecoderConfig.tiny(vocab_size=tok.vocab_size),
                                rngs=nnx.Rngs(step)), publish, step)
    os.makedirs(os.path.join(publish, "5.orbax-checkpoint-tmp-1"))  # a publish cut short
    port = reserved_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ac2_jax.serving", "--model=tiny", f"--port={port}",
         "--admin_key=sk-cli", f"--publish_dir={publish}", "--max_context=128"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models",
                              headers={"Authorization": "Bearer sk-cli"})
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.5)
        entry = r.json()["data"][0]
        assert entry["policy_version"] == 4 and entry["learner_step"] is None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
