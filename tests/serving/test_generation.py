"""The sampling routes over real HTTP: incremental streaming, disconnects,
sampler failures and CPU work off the event loop.

`GatedSampler` is a test double of the Sampler protocol (the protocol is what
is under test here): it emits the first token of its script at once and the
rest only after the test opens its gate, so ordering (not timing) shows what
streams when.
Streams against the real JaxSampler are in tests/serving/test_app.py.
"""

import asyncio
import json
import ssl
import threading

import httpx
import openai
import pytest

from ac2_jax.sampling import SamplerError, SampleResult
from ac2_jax.serving.app import build_app
from ac2_jax.serving.core import generation
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.trace import TraceStore

ADMIN = "sk-admin-gen"
WAIT_S = 60  # a generous bound on waits for the server thread; never asserted on
# One CA bundle for the module's HTTP clients: a default httpx client (an openai client's
# too) loads its own (~30 ms of CPU, even for http://).
SSL = ssl.create_default_context()


class GatedSampler:
    """Emits `script[0]`, then the rest once `gate` is set; records cancellations.
    It takes grammars (`supports_constraints`) and records them, not applying them."""

    supports_constraints = True

    def __init__(self, script: list[int], max_context: int = 512):
        self.script = list(script)
        self.max_context = max_context
        self.policy_version = 0
        self.gate = threading.Event()
        self.emitted = 0
        self.finished = 0
        self.cancelled = threading.Event()
        self.fail_with: Exception | None = None

    def load_weights(self, step=None):
        return self.policy_version

    def open_all(self):
        self.gate.set()

    async def generate(self, prompt_ids, params, *, on_tokens=None):
        self.last_params = params
        if self.fail_with is not None:
            raise self.fail_with
        out = self.script[:params.max_tokens]
        try:
            for i, t in enumerate(out):
                while i > 0 and not self.gate.is_set():
                    await asyncio.sleep(0.005)
                self.emitted += 1
                if on_tokens is not None:
                    on_tokens([t], [-0.25])
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        self.finished += 1
        return SampleResult(out, [-0.25] * len(out), "length", self.policy_version)


@pytest.fixture()
def served(tmp_path):
    tok = build_tiny_tokenizer(str(tmp_path / "tok"))
    sampler = GatedSampler(tok.encode("one two three four five six"))
    store = TraceStore(str(tmp_path / "traces.jsonl"))
    app = build_app(sampler, tok, admin_key=ADMIN, trace_store=store, model_name="tiny")
    url, stop = serve_in_thread(app)
    admin = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"},
                         timeout=WAIT_S)
    yield dict(tok=tok, sampler=sampler, store=store, url=url, admin=admin)
    sampler.open_all()
    admin.close()
    stop()


def new_rollout(env, task="t"):
    info = env["admin"].post("/v1/rollouts", json={"task_id": task}).json()
    client = openai.OpenAI(base_url=info["base_url"], api_key=info["api_key"], max_retries=0,
                           timeout=WAIT_S, http_client=httpx.Client(verify=SSL))
    return info, client


MSG = [{"role": "user", "content": "count"}]


def test_chunks_arrive_while_the_sampler_is_still_decoding(served):
    sampler = served["sampler"]
    info, client = new_rollout(served)
    n = len(sampler.script)
    stream = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=n,
                                            stream=True, stream_options={"include_usage": True},
                                            logprobs=True)
    it = iter(stream)
    text, seen_lps = "", 0
    while not text.strip():  # the role chunk, then the first content
        ch = next(it)
        if ch.choices and ch.choices[0].delta.content:
            text += ch.choices[0].delta.content
            seen_lps += len(ch.choices[0].logprobs.content)
    # Ordering: content arrived while the sampler had emitted only its first token.
    assert sampler.emitted == 1 and sampler.finished == 0
    sampler.open_all()
    chunks = list(it)
    text += "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    seen_lps += sum(len(c.choices[0].logprobs.content) for c in chunks
                    if c.choices and c.choices[0].logprobs)
    plain = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=n)
    assert text == plain.choices[0].message.content == "one two three four five six"
    assert seen_lps == n and chunks[-1].usage.completion_tokens == n
    assert [c.choices[0].finish_reason for c in chunks if c.choices and
            c.choices[0].finish_reason] == ["length"]
    status = served["admin"].get(f"/v1/rollouts/{info['rollout_id']}").json()
    assert status["num_completions"] == 2 and status["aborted_completions"] == 0


def test_an_aborted_stream_cancels_and_records_nothing(served):
    sampler = served["sampler"]
    info, _ = new_rollout(served)
    with httpx.Client(base_url=served["url"], timeout=WAIT_S, verify=SSL,
                      headers={"Authorization": f"Bearer {info['api_key']}"}) as key:
        with key.stream("POST", "/v1/chat/completions", json={
                "model": "tiny", "messages": MSG, "max_tokens": 6, "stream": True}) as r:
            lines = r.iter_lines()
            got = ""
            while "one" not in got:
                got += next(lines)
        # The client closed the connection mid-stream (sampler still gated).
    assert sampler.cancelled.wait(WAIT_S) and sampler.finished == 0
    status = served["admin"].get(f"/v1/rollouts/{info['rollout_id']}").json()
    assert status["aborted_completions"] == 1 and status["num_completions"] == 0
    trace = served["admin"].get(f"/v1/rollouts/{info['rollout_id']}/trace").json()
    assert trace["episodes"] == []  # no trainable tokens
    served["admin"].post(f"/v1/rollouts/{info['rollout_id']}/finish", json={"reward": 1})
    (stored,) = served["store"].load()
    assert stored.num_agent_tokens == 0 and stored.metrics["aborted_completions"] == 1


def test_a_client_that_leaves_a_plain_request_cancels_it(served):
    sampler = served["sampler"]
    info, _ = new_rollout(served)
    with pytest.raises(httpx.ReadTimeout):  # the client gives up; the sampler is still gated
        httpx.post(served["url"] + "/v1/chat/completions", timeout=1.0, verify=SSL,
                   headers={"Authorization": f"Bearer {info['api_key']}"},
                   json={"model": "tiny", "messages": MSG, "max_tokens": 6})
    assert sampler.cancelled.wait(WAIT_S) and sampler.finished == 0
    status = served["admin"].get(f"/v1/rollouts/{info['rollout_id']}").json()
    assert status["aborted_completions"] == 1 and status["num_completions"] == 0
    assert served["admin"].get(f"/v1/rollouts/{info['rollout_id']}/trace").json()[
        "episodes"] == []


def test_sampler_error_is_503_and_ends_the_rollout_as_infra_error(served):
    sampler = served["sampler"]
    info, client = new_rollout(served)
    other, other_client = new_rollout(served, "other")
    sampler.fail_with = SamplerError("worker crashed: secret internals")
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="tiny", messages=MSG, max_tokens=2)
    assert e.value.status_code == 503 and e.value.code == "sampler_error"
    assert set(e.value.body) == {"message", "type", "param", "code"}
    assert "secret" not in e.value.message
    sampler.fail_with = None
    sampler.open_all()
    status = served["admin"].get(f"/v1/rollouts/{info['rollout_id']}").json()
    assert status["status"] == "infra_error" and status["sampler_errors"] == 1
    assert [t.status for t in served["store"].load()] == ["infra_error"]
    # Another rollout is untouched and still samples.
    sampler.script = sampler.script[:1]
    ok = other_client.chat.completions.create(model="tiny", messages=MSG, max_tokens=1)
    assert ok.choices[0].finish_reason == "length"
    assert served["admin"].get(f"/v1/rollouts/{other['rollout_id']}").json()["status"] == \
        "running"


def test_slow_rendering_does_not_stall_the_event_loop(served, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    real = generation.build_prompt_ids

    def slow_build(*args, **kw):
        entered.set()
        assert release.wait(WAIT_S)
        return real(*args, **kw)

    monkeypatch.setattr(generation, "build_prompt_ids", slow_build)
    served["sampler"].script = served["sampler"].script[:1]
    info, client = new_rollout(served)
    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("r", client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=1)))
    worker.start()
    assert entered.wait(WAIT_S)
    # The big request is still rendering, and a cheap route answers meanwhile.
    r = served["admin"].get("/v1/models")
    assert r.status_code == 200 and not release.is_set() and "r" not in result
    release.set()
    worker.join(WAIT_S)
    assert result["r"].choices[0].message.content == "one"


def test_forced_tool_call_is_a_grammar_on_the_sampled_tokens(served):
    """A named tool_choice puts nothing into the prompt: the request's params carry
    the tool-call grammar, the whole call is output (loss mask 1) and the trace
    records the grammar. (This double does not apply it; tests/serving/
    test_structured.py samples under it with the JaxSampler.)"""
    from ac2_jax.sampling import tool_call_grammar
    tok = served["tok"]
    sampler = served["sampler"]
    sampler.script = tok.encode('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>')
    sampler.open_all()
    info, client = new_rollout(served)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    resp = client.chat.completions.create(
        model="tiny", messages=MSG, tools=tools, max_tokens=len(sampler.script),
        tool_choice={"type": "function", "function": {"name": "add"}})
    (call,) = resp.choices[0].message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1}
    assert sampler.last_params.constraint == tool_call_grammar(tok, tools, "add")
    trace = served["admin"].get(f"/v1/rollouts/{info['rollout_id']}/trace").json()
    (ep,) = trace["episodes"]
    (comp,) = ep["completions"]
    assert comp["constraint"] == sampler.last_params.constraint
    assert tok.decode(comp["prompt_ids"]).endswith("<|im_start|>assistant\n")  # no opening
    assert comp["output_ids"] == sampler.script
    assert ep["loss_mask"] == [0] * len(comp["prompt_ids"]) + [1] * len(sampler.script)
    assert resp.usage.prompt_tokens == len(comp["prompt_ids"])


def test_malformed_tool_calls_are_counted_on_the_rollout(served):
    tok, sampler = served["tok"], served["sampler"]
    sampler.script = tok.encode("<tool_call>\n{not json}\n</tool_call>")
    sampler.open_all()
    info, client = new_rollout(served)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    resp = client.chat.completions.create(model="tiny", messages=MSG, tools=tools,
                                          max_tokens=len(sampler.script))
    assert resp.choices[0].message.tool_calls is None
    assert "{not json}" in resp.choices[0].message.content  # left as text, and counted
    status = served["admin"].get(f"/v1/rollouts/{info['rollout_id']}").json()
    assert status["malformed_tool_calls"] == 1


def test_model_at_adapter_routes_to_that_lora_adapter(tmp_path):
    """`model: "tiny@a"` samples with adapter a of the sampler's bank (the same
    tokens and log-probs as a server of base + a alone), `tiny` with the base;
    /v1/models lists the adapters; an unknown adapter is a 404 naming the served
    ones; the trace records the adapter."""
    import httpx
    import jax
    from flax import nnx

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.models.lora import LoRAConfig
    from ac2_jax.sampling.engine.jax_sampler import JaxSampler

    tok = build_tiny_tokenizer(str(tmp_path / "tok"))
    cfg = DecoderConfig.tiny(vocab_size=tok.vocab_size, initializer_range=0.3,
                             max_position_embeddings=128)
    base = Decoder(cfg, rngs=nnx.Rngs(0))
    one = Decoder(cfg.replace(lora=LoRAConfig(rank=4)), rngs=nnx.Rngs(1))
    nnx.update(one, nnx.state(base, nnx.Not(nnx.LoRAParam)))
    leaves, tree = jax.tree.flatten(nnx.state(one, nnx.LoRAParam))
    keys = jax.random.split(jax.random.PRNGKey(5), len(leaves))
    nnx.update(one, jax.tree.unflatten(tree, [0.5 * jax.random.normal(k, x.shape)
                                              for k, x in zip(keys, leaves, strict=True)]))
    bank = Decoder(cfg.replace(lora=LoRAConfig(rank=4, slots=2)), rngs=nnx.Rngs(0))
    nnx.update(bank, nnx.state(base, nnx.Param))
    kw = dict(max_context=128, max_batch=2, min_batch=2, min_cache_len=128,
              eos_token_ids=tok.stop_token_ids, tokenizer=tok, seed=0)
    messages = [{"role": "user", "content": "hello there"}]

    def ask(url, model):
        client = openai.OpenAI(base_url=url + "/v1", api_key=ADMIN, max_retries=0, timeout=120,
                               http_client=httpx.Client(verify=SSL))
        r = client.chat.completions.create(model=model, messages=messages, temperature=0,
                                           max_tokens=8, logprobs=True)
        return r.choices[0].message.content, [t.logprob for t in r.choices[0].logprobs.content]

    with JaxSampler(one, **kw) as alone, JaxSampler(base, **kw) as plain:
        url, stop = serve_in_thread(build_app(alone, tok, admin_key=ADMIN, model_name="tiny"))
        try:
            want_a = ask(url, "tiny")
        finally:
            stop()
        url, stop = serve_in_thread(build_app(plain, tok, admin_key=ADMIN, model_name="tiny"))
        try:
            want_base = ask(url, "tiny")
        finally:
            stop()
    assert want_a != want_base
    store = TraceStore(str(tmp_path / "traces.jsonl"))
    with JaxSampler(bank, **kw) as served:
        served.add_adapter("a", one)
        app = build_app(served, tok, admin_key=ADMIN, model_name="tiny", trace_store=store)
        url, stop = serve_in_thread(app)
        try:
            got_a, got_base = ask(url, "tiny@a"), ask(url, "tiny")
            assert got_a[0] == want_a[0] and got_base[0] == want_base[0]
            assert got_a[1] == pytest.approx(want_a[1], abs=1e-5)
            ids = [m["id"] for m in httpx.get(url + "/v1/models", headers={
                "Authorization": f"Bearer {ADMIN}"}).json()["data"]]
            assert ids == ["tiny", "tiny@a"]
            r = httpx.post(url + "/v1/chat/completions", headers={
                "Authorization": f"Bearer {ADMIN}"}, json={"model": "tiny@b",
                                                            "messages": messages})
            assert r.status_code == 404, r.text
            err = r.json()["error"]
            assert err["code"] == "model_not_found" and "'tiny@a'" in err["message"]
            info = httpx.post(url + "/v1/rollouts", headers={"Authorization": f"Bearer {ADMIN}"},
                              json={"task_id": "t"}).json()
            client = openai.OpenAI(base_url=info["base_url"], api_key=info["api_key"],
                                   max_retries=0, timeout=120)
            client.chat.completions.create(model="tiny@a", messages=messages, max_tokens=4)
            httpx.post(f"{url}/v1/rollouts/{info['rollout_id']}/finish",
                       headers={"Authorization": f"Bearer {ADMIN}"}, json={"reward": 1.0})
        finally:
            stop()
    (trace,) = store.read()
    comps = [c for ep in trace.episodes for c in ep.completions]
    assert comps and all(c.adapter == "a" for c in comps)
