"""sampling/remote/fleet: FleetSampler over backend samplers.

In this process: routing, weight loads and failures over two real
JaxSamplers serving *different* weights (seeds 0 and 1), so a result's
log-probs tell which backend sampled it (forward pass, fp32, atol 1e-4), and
an SGLang client of a port nobody listens on (connection refused).

Then the fleet as deployed: 2 backend processes (`python -m
ac2_jax.serving.backend`, seeds 0 and 1) behind one endpoint (real HTTP, the
`openai` client of benchmarks/endpoint_harness): 16 concurrent rollouts
split across both, each stored trace exactly its own conversation and
sampled by one backend; a publish reaches both; one backend frozen with
requests in flight, then SIGKILLed: those rollouts end infra_error, the
rest finish, new rollouts succeed on the live one.
"""

import asyncio
import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest
from flax import nnx

from ac2_jax.models import Decoder, DecoderConfig, publish_weights
from ac2_jax.sampling import (
    FleetSampler,
    JaxSampler,
    SamplerError,
    SamplerUnavailable,
    SamplingParams,
    SGLangSampler,
    route_key,
)
from ac2_jax.serving.app import build_app
from ac2_jax.serving.server import load_policy, serve_in_thread
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.trace import TraceStore
from benchmarks.endpoint_harness import BackendProcess, audit, run_load
from tests.support.child_env import child_xla_flags
from tests.support.ports import refused_url
from tests.support.serving_helpers import forward_logprobs

ADMIN = "sk-fleet-admin"
CONTEXT = 256


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def tiny(tok, seed):
    """The model `load_policy("tiny", seed=seed)` (so a backend process) serves."""
    return Decoder(DecoderConfig.tiny(vocab_size=tok.vocab_size), rngs=nnx.Rngs(seed))


@pytest.fixture(scope="module")
def models(tok):
    return [tiny(tok, 0), tiny(tok, 1)]


def which(models, prompt, output_ids, output_logprobs) -> list[int]:
    """Indices of the models whose log-probs (T=1) are these."""
    seq = list(prompt) + list(output_ids)
    return [i for i, m in enumerate(models)
            if np.allclose(forward_logprobs(m, seq)[len(prompt):], output_logprobs, atol=1e-4)]


def of(models, prompt, r) -> list[int]:
    return which(models, prompt, r.output_ids, r.output_logprobs)


def jax_samplers(models, **kw):
    """No EOS: every request runs to max_tokens."""
    return [JaxSampler(m, max_context=128, max_batch=4, steps_per_sync=4, fixed_shapes=True, **kw)
            for m in models]


# ---------------------------------------------------------------- in process


def test_a_key_stays_on_one_backend_and_new_keys_go_to_the_least_loaded(models, tok):
    samplers = jax_samplers(models)
    fleet = FleetSampler(samplers, names=["a", "b"], max_keys=8)
    prompts = {k: tok.encode(f"rollout {k} says hi") for k in range(8)}
    params = SamplingParams(temperature=1.0, max_tokens=3)

    async def rollout(k):
        with route_key(f"ro-{k}"):
            return [await fleet.generate(prompts[k], params) for _ in range(3)]

    async def go():
        out = await asyncio.gather(*(rollout(k) for k in range(8)))
        for k in (8, 9):  # two more keys: the 2 least recently used are forgotten
            with route_key(f"ro-{k}"):
                await fleet.generate(prompts[0], params)
        return out

    try:
        results = asyncio.run(go())
    finally:
        for s in samplers:
            s.close()
    served = {}
    for k, rs in enumerate(results):
        got = {tuple(of(models, prompts[k], r)) for r in rs}
        assert len(got) == 1 and len(next(iter(got))) == 1, (k, got)  # one backend per key
        served[k] = next(iter(got))[0]
    st = fleet.status()
    # Both backends got keys; each backend's request count is what it served.
    assert sorted(set(served.values())) == [0, 1]
    for i, row in enumerate(st["backends"]):
        mine = sum(v == i for v in served.values())
        assert row["up"] and row["errors"] == 0
        assert 3 * mine <= row["requests"] <= 3 * mine + 2 and mine <= row["keys"] <= mine + 2
    assert sum(r["requests"] for r in st["backends"]) == 26
    # 10 keys, at most 8 remembered: the 2 least recently used were dropped (counted).
    assert st["route_keys"] == 8 and st["route_evictions"] == 2
    assert fleet.route_of("ro-9") in ("a", "b")
    assert st["moved_keys"] == 0 and st["retried"] == 0


def test_load_weights_reaches_every_backend_and_a_stale_one_is_taken_out(models, tok,
                                                                         tmp_path):
    new = tiny(tok, 2)
    publish_weights(new, str(tmp_path / "pub"), 1)
    own = [tiny(tok, 0), tiny(tok, 1), tiny(tok, 0)]  # loads write into the model
    a, b = jax_samplers(own[:2], publish_dir=str(tmp_path / "pub"))
    c, = jax_samplers(own[2:])  # no publish_dir: its load fails
    fleet = FleetSampler([a, b, c], names=["a", "b", "c"], retry_s=0.05)
    prompt = tok.encode("after the publish")
    try:
        assert fleet.load_weights() == 1
        assert fleet.policy_version == a.policy_version == b.policy_version == 1
        st = fleet.status()
        assert [r["up"] for r in st["backends"]] == [True, True, False]
        assert "publish_dir" in st["backends"][2]["last_error"]

        async def go():
            out = []
            for k in range(6):
                with route_key(f"k{k}"):
                    out.append(await fleet.generate(prompt, SamplingParams(max_tokens=3)))
                await asyncio.sleep(0.03)  # revival probes of c run meanwhile (and fail)
            return out

        results = asyncio.run(go())
        deadline = time.monotonic() + 10
        while "revival failed" not in (fleet.status()["backends"][2]["last_error"] or ""):
            assert time.monotonic() < deadline  # c's probe answers, its load fails again
            time.sleep(0.01)
    finally:
        for s in (a, b, c):
            s.close()
    # Every result comes from the new weights, version 1; c (stale) never served.
    for r in results:
        assert r.policy_version == 1
        ref = forward_logprobs(new, prompt + r.output_ids)[len(prompt):]
        np.testing.assert_allclose(r.output_logprobs, ref, atol=1e-4)
    st = fleet.status()
    assert [r["requests"] > 0 for r in st["backends"]] == [True, True, False]
    assert not st["backends"][2]["up"] and "revival failed" in st["backends"][2]["last_error"]


def test_a_dead_backend_fails_only_its_in_flight_requests(models, tok):
    a, b = jax_samplers(models)
    fleet = FleetSampler([a, b], names=["a", "b"], retry_s=60)
    prompts = [tok.encode(f"long rollout {k}") for k in range(4)]
    params = SamplingParams(temperature=1.0, max_tokens=60)
    gate, b_busy = threading.Event(), threading.Event()

    def hold_on_b(k):
        def on_tokens(ids, lps):  # b's worker waits here (mid-request) until b is closed
            if fleet.route_of(f"ro-{k}") == "b":
                b_busy.set()
                gate.wait(30)
        return on_tokens

    async def one(k):
        with route_key(f"ro-{k}"):
            try:
                return await fleet.generate(prompts[k], params, on_tokens=hold_on_b(k))
            except SamplerError as e:
                return e

    def close_b():  # b dies with its requests running
        closing = threading.Thread(target=b.close)
        closing.start()
        while True:
            try:
                b.probe()
            except SamplerError:
                break  # closed: its worker stops at the next chunk boundary
            time.sleep(0.005)
        gate.set()
        closing.join()

    async def go():
        tasks = [asyncio.ensure_future(one(k)) for k in range(4)]
        await asyncio.to_thread(b_busy.wait, 30)
        await asyncio.to_thread(close_b)
        return await asyncio.gather(*tasks)

    try:
        results = asyncio.run(go())
        on_b = [k for k in range(4) if fleet.route_of(f"ro-{k}") == "b"]
        assert on_b and len(on_b) < 4
        for k, r in enumerate(results):
            if k in on_b:
                assert isinstance(r, SamplerError) and "closed" in str(r)
            else:
                assert of(models, prompts[k], r) == [0]
        deadline = time.monotonic() + 10
        while fleet.status()["live"] != 1:  # the health check runs in a thread
            assert time.monotonic() < deadline
            time.sleep(0.01)

        async def after():
            out = []
            for k in on_b + [9]:  # b's keys move to a; a new key goes to a
                with route_key(f"ro-{k}"):
                    out.append(await fleet.generate(prompts[0], SamplingParams(max_tokens=2)))
            return out

        for r in asyncio.run(after()):
            assert of(models, prompts[0], r) == [0]
    finally:
        a.close()
    st = fleet.status()
    assert st["moved_keys"] == len(on_b)
    assert st["backends"][1]["errors"] == len(on_b) and not st["backends"][1]["up"]
    assert st["backends"][0]["errors"] == 0


def test_a_refused_connection_sends_the_request_elsewhere_and_none_left_is_clear(models, tok):
    dead_url = refused_url()
    dead = SGLangSampler(dead_url, max_context=128, vocab_size=tok.vocab_size)
    live, = jax_samplers(models[:1])
    fleet = FleetSampler([dead, live], retry_s=60)  # dead has no load: it is picked first
    prompt = tok.encode("anyone there")
    try:
        r = asyncio.run(fleet.generate(prompt, SamplingParams(max_tokens=2)))
        assert of(models, prompt, r) == [0]
        st = fleet.status()
        assert st["retried"] == 1 and st["backends"][0]["name"] == dead_url
        assert not st["backends"][0]["up"] and st["backends"][0]["unavailable"] == 1
        assert "unreachable" in st["backends"][0]["last_error"]
        live.close()
        with pytest.raises(SamplerUnavailable, match="no live backend.*" + dead_url):
            asyncio.run(fleet.generate(prompt, SamplingParams(max_tokens=2)))
    finally:
        live.close()


def test_bad_setups_are_refused(models, tok):
    with pytest.raises(ValueError, match="at least one"):
        FleetSampler([])
    with pytest.raises(TypeError, match="not a Sampler"):
        FleetSampler([object()])
    s = [SGLangSampler(f"http://127.0.0.1:{p}", max_context=64, policy_version=v)
         for p, v in ((1, 0), (2, 3))]
    with pytest.raises(ValueError, match=r"different policy versions \[0, 3\]"):
        FleetSampler(s)
    with pytest.raises(ValueError, match="distinct"):
        FleetSampler(s[:1] * 2)
    with pytest.raises(ValueError, match="lists a URL twice"):
        load_policy("tiny", backends=["http://a:1", "http://a:1"])
    with pytest.raises(ValueError, match="drop --sglang_url"):
        load_policy("tiny", backends=["http://a:1"], sglang_url="http://b:2")


# ---------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def fleet_env(tmp_path_factory, tok):
    """2 backend processes (seeds 0 and 1) and the endpoint over them (load_policy
    with backends=...), in this process."""
    d = tmp_path_factory.mktemp("fleet")
    procs = [BackendProcess(str(d / f"backend{i}.log"), env={"XLA_FLAGS": child_xla_flags()},
                            flags=[f"--seed={i}", f"--max_context={CONTEXT}", "--max_batch=8"])
             for i in range(2)]
    for p in procs:
        p.launch()
    try:
        urls = [p.wait_ready() for p in procs]
        fleet, _, _ = load_policy("tiny", backends=urls, max_context=CONTEXT,
                                  publish_dir=str(d / "publish"), export_dir=str(d / "export"),
                                  tokenizer_dir=str(d / "tok"))
        store = str(d / "traces.jsonl")
        url, stop = serve_in_thread(build_app(fleet, tok, admin_key=ADMIN, trace_store=store,
                                              model_name="tiny"))
        yield {"procs": procs, "urls": urls, "fleet": fleet, "url": url, "store": store,
               "publish": str(d / "publish")}
        stop()
    finally:
        for p in procs:
            p.kill()


def load(env, run_id, rollouts, turns, concurrency=None):
    return asyncio.run(run_load(env["url"], ADMIN, rollouts=rollouts, turns=turns,
                                concurrency=concurrency or rollouts, max_tokens=4,
                                run_id=run_id))


def traces_of(env, run_id):
    return [t for t in TraceStore(env["store"]).read(on_error="raise")
            if t.metadata.get("harness_run") == run_id]


def served(env, only=None) -> list[int]:
    """Requests each backend process says it finished (`only`: that one)."""
    urls = env["urls"] if only is None else [env["urls"][only]]
    return [httpx.get(u + "/get_server_info").json()["finished"] for u in urls]


def admin_status(env) -> dict:
    r = httpx.get(env["url"] + "/v1/models", headers={"Authorization": f"Bearer {ADMIN}"})
    return r.json()["data"][0]["sampler_stats"]


@pytest.mark.full  # two backend processes under load
def test_16_concurrent_rollouts_split_across_two_backend_processes_then_a_publish(
        fleet_env, tok, models):
    env, names = fleet_env, fleet_env["urls"]
    report = load(env, "split", rollouts=16, turns=2)
    assert report["finished"] == 16, report["results"]
    traces = traces_of(env, "split")
    a = audit(traces, "split", 16, 2, tok.decode)
    assert a["stored"] == list(range(16)) and a["cross_wired"] == [] and a["not_finished"] == {}
    ids = {r["index"]: r["rollout_id"] for r in report["results"]}
    per_backend = [0, 0]
    for t in traces:
        comps = [c for ep in t.episodes for c in ep.completions]
        got = {tuple(which(models, c.prompt_ids, c.output_ids, c.output_logprobs))
               for c in comps}
        assert len(comps) == 2 and len(got) == 1, got  # one backend sampled the whole rollout
        (i,), = got
        per_backend[i] += 1
        assert env["fleet"].route_of(ids[t.metadata["index"]]) == names[i]
        assert {c.policy_version for c in comps} == {0}
    assert min(per_backend) >= 1, per_backend
    st = admin_status(env)
    assert [b["up"] for b in st["backends"]] == [True, True] and st["live"] == 2
    assert [b["requests"] for b in st["backends"]] == [2 * n for n in per_backend]
    assert [b["errors"] for b in st["backends"]] == [0, 0]
    assert served(env) == [2 * n for n in per_backend]  # the backends' own counts

    # Publish: both backends load the new weights; completions after it carry
    # version 1 and the new weights' log-probs, on both backends.
    new = tiny(tok, 2)
    publish_weights(new, env["publish"], 1)
    assert env["fleet"].load_weights() == 1 and env["fleet"].policy_version == 1
    for u in env["urls"]:
        assert httpx.get(u + "/get_model_info").json()["weight_version"] == "1"
    before = served(env)
    report = load(env, "pub", rollouts=4, turns=1)
    assert report["finished"] == 4
    traces = traces_of(env, "pub")
    assert audit(traces, "pub", 4, 1, tok.decode)["cross_wired"] == []
    for t in traces:
        for c in (c for ep in t.episodes for c in ep.completions):
            assert c.policy_version == 1
            assert which([new], c.prompt_ids, c.output_ids, c.output_logprobs) == [0]
    assert all(x > y for x, y in zip(served(env), before))  # both served after it
    assert admin_status(env)["policy_version"] == 1


@pytest.mark.full  # backend processes, one killed
def test_killing_one_backend_mid_load_ends_only_its_rollouts(fleet_env, tok):
    env, fleet = fleet_env, fleet_env["fleet"]
    victim, name = env["procs"][1], env["urls"][1]
    base = fleet.status()["backends"]
    out = {}
    harness = threading.Thread(target=lambda: out.update(report=load(env, "kill", 16, 3)))
    harness.start()
    try:
        deadline = time.monotonic() + 60
        while sum(b["requests"] - b0["requests"]
                  for b, b0 in zip(fleet.status()["backends"], base)) < 20:
            assert time.monotonic() < deadline and harness.is_alive()
            time.sleep(0.01)
        # Freeze the victim so requests are surely in flight on it, then kill it.
        os.kill(victim.pid, signal.SIGSTOP)
        stuck, since = -1, time.monotonic()
        while time.monotonic() - since < 0.5:
            n = fleet.status()["backends"][1]["in_flight"]
            if n != stuck:
                stuck, since = n, time.monotonic()
            time.sleep(0.02)
        assert stuck >= 1
        victim.kill()
    finally:
        harness.join(timeout=120)
    report = out["report"]
    traces = traces_of(env, "kill")
    a = audit(traces, "kill", 16, 3, tok.decode)
    assert a["stored"] == list(range(16)) and a["cross_wired"] == [] and a["duplicates"] == []
    ended = {i for i, s in a["not_finished"].items() if s == "infra_error"}
    assert ended == set(a["not_finished"]) == set(report["lost"])
    assert len(ended) >= stuck and report["finished"] == 16 - len(ended)
    ids = {r["index"]: r["rollout_id"] for r in report["results"]}
    assert all(fleet.route_of(ids[i]) == name for i in ended)  # only the victim's rollouts
    st = fleet.status()["backends"][1]
    assert st["errors"] - base[1]["errors"] - (st["unavailable"] - base[1]["unavailable"]) \
        == len(ended)  # one failed in-flight request per ended rollout
    deadline = time.monotonic() + 10
    while fleet.status()["live"] != 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)

    # New rollouts succeed, all on the live backend.
    before = served(env, only=0)[0]
    report = load(env, "after", rollouts=4, turns=1)
    assert report["finished"] == 4
    assert audit(traces_of(env, "after"), "after", 4, 1, tok.decode)["not_finished"] == {}
    assert all(fleet.route_of(r["rollout_id"]) == env["urls"][0] for r in report["results"])
    assert served(env, only=0)[0] == before + 4
    assert admin_status(env)["backends"][1]["up"] is False
