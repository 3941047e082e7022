"""The endpoint over real HTTP with the official `openai` client.

The sampler is the real JaxSampler over a tiny Decoder fitted to a scripted
3-turn tool conversation (tests/support/serving_helpers.py), so greedy decoding
holds the conversation and the recorded traces can be checked token by token.
"""

import asyncio
import functools
import json
import ssl
import time

import httpx
import numpy as np
import openai
import pytest
from flax import nnx

from ac2_jax.models import Decoder
from ac2_jax.models.io.params_io import publish_weights
from ac2_jax.sampling import Sampler
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.serving.app import build_app
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.trace import TraceStore
from tests.support.ports import refused_url
from tests.support.serving_helpers import (
    SYSTEM,
    TOOLS,
    TURNS,
    USER,
    add_tool,
    fit_tiny_model,
    forward_logprobs,
    scripted_sequence,
    tiny_config,
)

ADMIN = "sk-admin-test"
# One CA bundle for the module's HTTP clients: a default httpx client (an openai
# client's too) loads its own (~30 ms of CPU, even for http://), ~100 times here.
SSL = ssl.create_default_context()
http_get = functools.partial(httpx.get, verify=SSL)
http_post = functools.partial(httpx.post, verify=SSL)
http_client = functools.partial(httpx.Client, verify=SSL)
async_http_client = functools.partial(httpx.AsyncClient, verify=SSL)
MAX_CONTEXT = 512


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("app")
    tok = build_tiny_tokenizer(str(tmp / "tok"))
    fitted = fit_tiny_model(tok)
    live = nnx.clone(fitted)  # load_weights writes into the sampler's model
    # One row count, one cache length, small prefill chunks: few compiles; the shape of
    # test_messages', test_responses' and the eval runner's samplers (the same fitted
    # model), so the run's persistent cache serves one module's programs to the others.
    sampler = JaxSampler(live, publish_dir=str(tmp / "publish"), max_context=MAX_CONTEXT,
                         max_batch=4, min_batch=4, min_cache_len=MAX_CONTEXT,
                         prefill_chunk=32, min_prefill_rows=4,
                         eos_token_ids=tok.stop_token_ids, tokenizer=tok)
    store = TraceStore(str(tmp / "traces.jsonl"))
    app = build_app(sampler, tok, admin_key=ADMIN, trace_store=store, model_name="tiny")
    url, stop = serve_in_thread(app)
    admin = http_client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=300)
    yield dict(tok=tok, model=fitted, sampler=sampler, store=store, url=url, admin=admin,
               tmp=tmp, app=app)
    admin.close()
    stop()
    sampler.close()


def create(env, task_id="task", **kw):
    r = env["admin"].post("/v1/rollouts", json={"task_id": task_id, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def client_for(info, async_=False):
    cls = openai.AsyncOpenAI if async_ else openai.OpenAI
    http = (async_http_client if async_ else http_client)(timeout=300)
    return cls(base_url=info["base_url"], api_key=info["api_key"], max_retries=0, timeout=300,
               http_client=http)


def run_tool_conversation(client, turns=3, **kw):
    """The scripted conversation through the openai client; returns the responses."""
    messages = [SYSTEM, USER]
    responses = []
    for _ in range(turns):
        resp = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                              temperature=0, max_tokens=64, logprobs=True, **kw)
        responses.append(resp)
        msg = resp.choices[0].message
        messages.append(msg)
        for call in msg.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": add_tool(call.function.arguments)})
    return responses, messages


def check_episode(env, episode, model=None):
    """Mask is 1 exactly on sampled tokens; logprobs match a forward pass (fp32, 1e-4)."""
    tokens, mask = episode["token_ids"], episode["loss_mask"]
    sampled = [t for c in episode["completions"] for t in c["output_ids"]]
    assert [t for t, m in zip(tokens, mask) if m] == sampled
    last = episode["completions"][-1]
    assert tokens == last["prompt_ids"] + last["output_ids"]
    lp = np.asarray(episode["sampler_logprobs"])
    assert np.all(lp[np.asarray(mask) == 0] == 0)
    ref = forward_logprobs(model or env["model"], tokens)
    np.testing.assert_allclose(lp[np.asarray(mask) == 1], ref[np.asarray(mask) == 1], atol=1e-4)


def test_jax_sampler_is_a_sampler(env):
    assert isinstance(env["sampler"], Sampler)


def test_three_turn_tool_conversation_is_one_episode(env):
    info = create(env, "calc-1", group_id="g1", metadata={"source": "test"})
    responses, _ = run_tool_conversation(client_for(info))
    for resp, (text, result) in zip(responses, TURNS):
        choice = resp.choices[0]
        if result is not None:  # a tool call, parsed
            assert choice.finish_reason == "tool_calls"
            (call,) = choice.message.tool_calls
            assert call.function.name == "add" and call.type == "function"
            assert json.loads(call.function.arguments) == json.loads(
                text.split("\n")[1])["arguments"]
        else:
            assert choice.finish_reason == "stop" and choice.message.content == text
        assert resp.policy_version == 0 and resp.system_fingerprint == "policy-0"

    status = env["admin"].get(f"/v1/rollouts/{info['rollout_id']}").json()
    assert status["status"] == "running" and status["num_completions"] == 3
    assert status["num_episodes"] == 1 and status["policy_versions"] == [0]
    done = env["admin"].post(f"/v1/rollouts/{info['rollout_id']}/finish",
                             json={"reward": 1.0, "artifacts": {"answer": "17"}}).json()
    assert done["status"] == "finished"

    trace = env["admin"].get(f"/v1/rollouts/{info['rollout_id']}/trace").json()
    assert (trace["task_id"], trace["group_id"], trace["reward"]) == ("calc-1", "g1", 1.0)
    assert trace["metadata"]["artifacts"] == {"answer": "17"}
    (episode,) = trace["episodes"]
    assert episode["agent"] == "main" and len(episode["completions"]) == 3
    check_episode(env, episode)
    tokens, mask = scripted_sequence(env["tok"])
    assert episode["token_ids"] == tokens and episode["loss_mask"] == mask
    # What the client saw is what was recorded.
    seen = [e.logprob for r in responses for e in r.choices[0].logprobs.content]
    np.testing.assert_allclose(seen, [x for x, m in zip(episode["sampler_logprobs"], mask) if m])
    stored = [t for t in env["store"].load() if t.metadata["rollout_id"] == info["rollout_id"]]
    assert len(stored) == 1 and stored[0].to_dict() == trace


def test_rewritten_history_and_other_agents_get_their_own_episodes(env):
    info = create(env, "calc-2")
    client = client_for(info)
    _, messages = run_tool_conversation(client, turns=1)
    transcript = "\n".join(str(m.get("content") if isinstance(m, dict) else m.content)
                           for m in messages)
    client.chat.completions.create(  # the compactor, labelled by header
        model="tiny", max_tokens=4, temperature=0, extra_headers={"X-Agent": "compactor"},
        messages=[{"role": "system", "content": "Summarize."},
                  {"role": "user", "content": transcript}])
    summary = [SYSTEM, {"role": "user", "content": "3 + 4 = 7 so far. What is 7 + 10?"}]
    client.chat.completions.create(model="tiny", messages=summary, tools=TOOLS, temperature=0,
                                   max_tokens=4)
    client.chat.completions.create(model="tiny", messages=[USER], max_tokens=3, temperature=0,
                                   user="end-user-7")  # OpenAI's end-user id: not a label
    client.chat.completions.create(model="tiny", messages=[USER], max_tokens=3, temperature=0,
                                   extra_body={"agent": "subagent:calc"})
    client.completions.create(model="tiny", prompt="3 + 4 =", max_tokens=2, temperature=0,
                              extra_headers={"X-Agent": "raw"})
    env["admin"].post(f"/v1/rollouts/{info['rollout_id']}/finish", json={"reward": 0.0})
    trace = env["admin"].get(f"/v1/rollouts/{info['rollout_id']}/trace").json()
    agents = [e["agent"] for e in trace["episodes"]]
    assert agents == ["main", "compactor", "main", "main", "subagent:calc", "raw"]
    assert [len(e["completions"]) for e in trace["episodes"]] == [1] * 6
    for episode in trace["episodes"]:
        check_episode(env, episode)


def test_32_concurrent_rollouts_give_32_separate_traces(env):
    infos = [create(env, f"conc-{i}", group_id="conc") for i in range(32)]

    async def one(i, info):
        client = client_for(info, async_=True)
        messages = [{"role": "user", "content": f"task number {i:02d} please"}]
        for turn in range(2):
            resp = await client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=6, temperature=1.0, seed=100 * i + turn)
            messages += [resp.choices[0].message, {"role": "user", "content": "go on"}]
        await client.close()

    async def all_of_them():
        await asyncio.gather(*(one(i, info) for i, info in enumerate(infos)))

    asyncio.run(all_of_them())
    before = len(env["store"].load())
    for i, info in enumerate(infos):
        r = env["admin"].post(f"/v1/rollouts/{info['rollout_id']}/finish", json={"reward": i})
        assert r.status_code == 200
    stored = {t.task_id: t for t in env["store"].load()[before:]}
    assert sorted(stored) == sorted(f"conc-{i}" for i in range(32))
    for i, info in enumerate(infos):
        trace = env["admin"].get(f"/v1/rollouts/{info['rollout_id']}/trace").json()
        assert trace["task_id"] == f"conc-{i}" and trace["reward"] == i
        (episode,) = trace["episodes"]
        assert len(episode["completions"]) == 2
        text = env["tok"].decode(episode["token_ids"])
        assert f"number {i:02d} " in text
        assert sum(f"number {j:02d} " in text for j in range(32)) == 1
        check_episode(env, episode)
        assert stored[f"conc-{i}"].to_dict() == trace


def api_error(response):
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return response.status_code, body["error"]


def test_bad_requests_are_4xx_and_change_nothing(env):
    a, b, c = create(env, "err-a"), create(env, "err-b"), create(env, "err-c")
    client_a = client_for(a)
    client_a.chat.completions.create(model="tiny", messages=[USER], max_tokens=2)
    env["admin"].post(f"/v1/rollouts/{c['rollout_id']}/finish", json={"status": "infra_error"})
    admin = env["admin"]

    def snapshot():
        return ([admin.get(f"/v1/rollouts/{x['rollout_id']}/trace").json() for x in (a, b, c)],
                len(env["store"].load()), len(env["app"].state.registry))

    before = snapshot()
    url = env["url"]
    chat = {"model": "tiny", "messages": [USER], "max_tokens": 2}

    def post(path, key=None, **kw):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return http_post(url + path, headers=headers, timeout=300, **kw)

    status, err = api_error(post("/v1/chat/completions", json=chat))
    assert status == 401 and "Missing API key" in err["message"]
    status, err = api_error(post("/v1/chat/completions", "sk-wrong", json=chat))
    assert status == 401 and err["code"] == "invalid_api_key"
    status, err = api_error(post("/v1/chat/completions", c["api_key"], json=chat))
    assert status == 401 and "no longer works" in err["message"]
    status, err = api_error(post(f"/v1/rollouts/{a['rollout_id']}/finish", b["api_key"],
                                 json={"reward": 1.0}))
    assert status == 404 and err["code"] == "rollout_not_found"
    status, err = api_error(http_get(url + f"/v1/rollouts/{a['rollout_id']}/trace",
                                      headers={"Authorization": f"Bearer {b['api_key']}"}))
    assert status == 404
    status, err = api_error(post("/v1/chat/completions", a["api_key"], content=b'{"model": "ti'))
    assert status == 400 and err["code"] == "invalid_json" and "Malformed JSON" in err["message"]
    status, err = api_error(post("/v1/rollouts", a["api_key"], json={"task_id": "x"}))
    assert status == 403
    status, err = api_error(post(f"/v1/rollouts/{a['rollout_id']}/finish", ADMIN,
                                 json={"reward": "high"}))
    assert status == 400 and err["param"] == "reward"
    status, err = api_error(post("/v1/rollouts/ro-nope/finish", ADMIN, json={}))
    assert status == 404
    status, err = api_error(post(f"/v1/rollouts/{c['rollout_id']}/finish", ADMIN, json={}))
    assert status == 409
    status, err = api_error(post("/v1/nowhere", ADMIN, json={}))
    assert status == 404 and "Unknown route" in err["message"]

    with pytest.raises(openai.NotFoundError, match="does not exist") as e:
        client_a.chat.completions.create(model="gpt-9", messages=[USER])
    assert e.value.code == "model_not_found"
    long = [{"role": "user", "content": "word " * MAX_CONTEXT}]
    with pytest.raises(openai.BadRequestError, match="maximum context length is 512") as e:
        client_a.chat.completions.create(model="tiny", messages=long)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="role"):
        client_a.chat.completions.create(model="tiny", messages=[{"role": "x", "content": "y"}])
    with pytest.raises(openai.AuthenticationError, match="no longer works"):
        client_for(c).chat.completions.create(model="tiny", messages=[USER])

    assert snapshot() == before
    assert admin.get(f"/v1/rollouts/{a['rollout_id']}").json()["num_completions"] == 1


def test_streaming_text_completions_and_models(env):
    client = openai.OpenAI(base_url=env["url"] + "/v1", api_key=ADMIN, max_retries=0,
                           http_client=http_client())
    assert [m.id for m in client.models.list()] == ["tiny"]
    messages = [SYSTEM, USER]
    plain = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                           temperature=0, max_tokens=64)
    stream = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                            temperature=0, max_tokens=64, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    calls = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or [])]
    assert [tc.function.arguments for tc in calls] == [
        tc.function.arguments for tc in plain.choices[0].message.tool_calls]
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == [
        "tool_calls"]
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens

    prompt = env["tok"].apply_chat_template(messages, tools=TOOLS)
    text = client.completions.create(model="tiny", prompt=prompt, max_tokens=64, temperature=0,
                                     logprobs=1)
    assert text.choices[0].text == TURNS[0][0]
    ids = client.completions.create(model="tiny", prompt=env["tok"].encode(prompt),
                                    max_tokens=64, temperature=0)
    assert ids.choices[0].text == TURNS[0][0]
    n3 = client.chat.completions.create(model="tiny", messages=[USER], n=3, max_tokens=4,
                                        temperature=1.0, seed=1)
    assert [c.index for c in n3.choices] == [0, 1, 2]


def test_models_shows_sampler_stats_to_the_admin_only(env):
    client = openai.OpenAI(base_url=env["url"] + "/v1", api_key=ADMIN, max_retries=0,
                           http_client=http_client())
    client.chat.completions.create(model="tiny", messages=[USER], max_tokens=2)
    admin = env["admin"].get("/v1/models").json()["data"][0]
    stats = admin["sampler_stats"]
    assert stats["compiled_shapes"] == env["sampler"].stats.compiled_shapes > 0
    assert set(stats) == {"compiled_shapes", "output_tokens", "request_errors",
                          "worker_restarts"}
    info = create(env, "models-stats")
    seen = http_get(env["url"] + "/v1/models",
                     headers={"Authorization": f"Bearer {info['api_key']}"}).json()["data"][0]
    assert "sampler_stats" not in seen and seen["id"] == "tiny"
    env["admin"].post(f"/v1/rollouts/{info['rollout_id']}/finish", json={"reward": 0.0})


def test_published_weights_give_new_policy_version(env):
    sampler, tok = env["sampler"], env["tok"]
    publish_dir = str(env["tmp"] / "publish")
    info = create(env, "weights")
    client = client_for(info)
    first = client.chat.completions.create(model="tiny", messages=[USER], max_tokens=3)
    assert first.policy_version == sampler.policy_version
    other = Decoder(tiny_config(tok), rngs=nnx.Rngs(42))
    step = sampler.policy_version + 7
    publish_weights(other, publish_dir, step)
    try:
        assert sampler.load_weights() == step and sampler.policy_version == step
        second = client.chat.completions.create(model="tiny", messages=[USER], max_tokens=3)
        assert second.policy_version == step and second.system_fingerprint == f"policy-{step}"
        env["admin"].post(f"/v1/rollouts/{info['rollout_id']}/finish", json={"reward": 0})
        trace = env["admin"].get(f"/v1/rollouts/{info['rollout_id']}/trace").json()
        versions = [c["policy_version"] for e in trace["episodes"] for c in e["completions"]]
        assert versions == [first.policy_version, step]
        check_episode(env, trace["episodes"][-1], model=other)  # sampled by the new weights
        assert trace["metrics"]["policy_versions"] == sorted({first.policy_version, step})
    finally:  # put the fitted weights back for the other tests
        publish_weights(env["model"], publish_dir, step + 1)
        sampler.load_weights()


def test_admin_load_weights_route_serves_a_published_step_or_refuses_it_whole(env):
    """POST /v1/admin/load_weights (what a learner in another process calls): the
    step is served at once; a rollout key gets 403, a bad field 400 naming it, an
    unpublished step 404, weights of another architecture 409, and a refused load
    leaves the served weights, version and learner_step as they were."""
    import dataclasses

    sampler, tok, admin = env["sampler"], env["tok"], env["admin"]
    publish_dir = str(env["tmp"] / "publish")
    base = sampler.policy_version

    def greedy():
        r = admin.post("/v1/completions", json={"model": "tiny", "prompt": "Add 2 and 3",
                                                  "max_tokens": 6, "temperature": 0,
                                                  "logprobs": 1})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["text"], c["logprobs"]["token_logprobs"], r.json()

    def load(body, **kw):
        return admin.post("/v1/admin/load_weights", json=body, **kw)

    text0, lps0, _ = greedy()
    other = Decoder(tiny_config(tok), rngs=nnx.Rngs(42))
    publish_weights(other, publish_dir, base + 1)
    try:
        r = load({"step": base + 1, "learner_step": 5})
        assert r.status_code == 200, r.text
        assert r.json() == {"object": "weights", "policy_version": base + 1, "learner_step": 5}
        assert sampler.policy_version == base + 1
        models = admin.get("/v1/models").json()["data"][0]
        assert models["policy_version"] == base + 1 and models["learner_step"] == 5
        text1, lps1, body1 = greedy()
        assert body1["system_fingerprint"] == f"policy-{base + 1}"

        # Refusals: each names what is wrong and changes nothing.
        info = create(env, "load-weights-key")
        as_rollout = http_post(env["url"] + "/v1/admin/load_weights", json={"step": base + 1},
                                headers={"Authorization": f"Bearer {info['api_key']}"})
        assert as_rollout.status_code == 403 and api_error(as_rollout)[1]["code"] == "admin_only"
        env["admin"].post(f"/v1/rollouts/{info['rollout_id']}/finish", json={"reward": 0.0})
        for body, param in (({}, "step"), ({"step": -1}, "step"), ({"step": "3"}, "step"),
                            ({"step": True}, "step"), ({"step": 1.5}, "step"),
                            ({"step": 1, "learner_step": -2}, "learner_step"),
                            ({"step": 1, "steps": 2}, "steps")):
            r = load(body)
            assert r.status_code == 400, (body, r.text)
            assert api_error(r)[1]["param"] == param, (body, r.text)
        r = load({"step": base + 50})
        assert r.status_code == 404 and api_error(r)[1]["code"] == "step_not_found"
        assert f"step {base + 50}" in api_error(r)[1]["message"].lower()
        wider = dataclasses.replace(tiny_config(tok), hidden_size=32, num_heads=2)
        publish_weights(Decoder(wider, rngs=nnx.Rngs(1)), publish_dir, base + 2)
        r = load({"step": base + 2, "learner_step": 6})
        assert r.status_code == 409 and api_error(r)[1]["code"] == "weights_not_loaded", r.text
        assert "shape" in api_error(r)[1]["message"]
        assert sampler.policy_version == base + 1
        models = admin.get("/v1/models").json()["data"][0]
        assert models["policy_version"] == base + 1 and models["learner_step"] == 5
        text2, lps2, _ = greedy()  # still the step-1 weights, whole
        assert text2 == text1
        np.testing.assert_allclose(lps2, lps1, atol=1e-5)
    finally:  # the fitted weights back, through the route
        publish_weights(env["model"], publish_dir, base + 3)
        r = load({"step": base + 3})
        assert r.status_code == 200 and r.json()["policy_version"] == base + 3
    text3, lps3, _ = greedy()
    assert text3 == text0
    np.testing.assert_allclose(lps3, lps0, atol=1e-5)


def test_rollout_timeout_finishes_as_timed_out(env):
    info = create(env, "slow", timeout_s=0.2)
    client = client_for(info)
    deadline = time.monotonic() + 60
    while env["admin"].get(f"/v1/rollouts/{info['rollout_id']}").json()["status"] == "running":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    status = env["admin"].get(f"/v1/rollouts/{info['rollout_id']}").json()
    assert status["status"] == "timed_out" and status["num_completions"] == 0
    with pytest.raises(openai.AuthenticationError, match="timed_out"):
        client.chat.completions.create(model="tiny", messages=[USER], max_tokens=2)
    stored = [t for t in env["store"].load() if t.metadata["rollout_id"] == info["rollout_id"]]
    assert [t.status for t in stored] == ["timed_out"]


def key_client(env, info):
    """Plain HTTP with a rollout's own key (what a harness, so often the policy, holds)."""
    return http_client(base_url=env["url"], timeout=300,
                        headers={"Authorization": f"Bearer {info['api_key']}"})


def test_rollout_key_cannot_grade_its_own_rollout_and_refusals_change_nothing(env):
    info = create(env, "self-grade", metadata={"expected": "secret-answer-17"})
    rid, admin = info["rollout_id"], env["admin"]
    client_for(info).chat.completions.create(model="tiny", messages=[USER], max_tokens=2)

    def snapshot():
        return (admin.get(f"/v1/rollouts/{rid}/trace").json(), len(env["store"].load()))

    before = snapshot()
    refused = [({"reward": 1.0}, "reward"), ({"reward": 0}, "reward"),
               ({"status": "finished", "reward": 1.0}, "reward"),
               ({"metrics": {"accuracy": 1.0}}, "metrics"),
               ({"status": "infra_error"}, "status"), ({"status": "timed_out"}, "status"),
               ({"hints": ["the answer is 17"]}, "hints"),
               ({"artifacts": {"answer": "17"}}, "artifacts")]
    with key_client(env, info) as own:
        for body, field in refused:
            status, err = api_error(own.post(f"/v1/rollouts/{rid}/finish", json=body))
            assert status == 403, (body, err)
            assert err["type"] == "permission_error" and err["code"] == "admin_only"
            assert err["param"] == field, (body, err)
            assert f"only the admin key may set '{field}'" in err["message"].lower(), err
            assert "admin key" in err["message"].split(";", 1)[1], err  # how to fix it
    # The official client sees the same refusal as its PermissionDeniedError.
    with pytest.raises(openai.PermissionDeniedError, match="may set 'reward'"):
        client_for(info).post(f"/rollouts/{rid}/finish", body={"reward": 1.0}, cast_to=object)

    assert snapshot() == before  # nothing stored, the trace unchanged
    status = admin.get(f"/v1/rollouts/{rid}").json()
    assert status["status"] == "running" and status["reward"] is None
    assert status["num_completions"] == 1
    # The key still works, and the admin can still grade the rollout.
    client_for(info).chat.completions.create(model="tiny", messages=[USER], max_tokens=2)
    done = admin.post(f"/v1/rollouts/{rid}/finish",
                      json={"reward": 1.0, "metrics": {"accuracy": 1.0}, "hints": ["h"]})
    assert done.status_code == 200, done.text
    assert done.json()["status"] == "finished" and done.json()["reward"] == 1.0
    (stored,) = [t for t in env["store"].load() if t.metadata["rollout_id"] == rid]
    assert stored.reward == 1.0 and stored.metrics["accuracy"] == 1.0 and stored.hints == ["h"]
    assert stored.metrics["num_completions"] == 2


@pytest.mark.parametrize("body", [{}, {"status": "finished"}])
def test_rollout_key_reads_its_own_rollout_without_admin_metadata_and_can_end_it(env, body):
    info = create(env, "own-view", group_id="gv", metadata={"expected": "secret-answer-17"})
    rid, admin = info["rollout_id"], env["admin"]
    client_for(info).chat.completions.create(model="tiny", messages=[USER], max_tokens=2)
    admin_summary = admin.get(f"/v1/rollouts/{rid}").json()
    admin_trace = admin.get(f"/v1/rollouts/{rid}/trace").json()
    assert admin_summary["metadata"]["expected"] == "secret-answer-17"
    assert admin_trace["metadata"]["expected"] == "secret-answer-17"
    hidden = {"metadata", "hints", "metrics"}
    with key_client(env, info) as own:
        summary = own.get(f"/v1/rollouts/{rid}")
        trace = own.get(f"/v1/rollouts/{rid}/trace")
        assert summary.status_code == 200 and trace.status_code == 200
        summary, trace = summary.json(), trace.json()
        assert "secret-answer" not in json.dumps(summary) + json.dumps(trace)
        assert hidden.isdisjoint(summary) and hidden.isdisjoint(trace)
        assert summary["status"] == "running" and summary["num_completions"] == 1
        assert summary["task_id"] == "own-view" and summary["group_id"] == "gv"
        # Everything else of its own trace, token for token.
        assert trace == {k: v for k, v in admin_trace.items() if k not in hidden}
        check_episode(env, trace["episodes"][0])

        done = own.post(f"/v1/rollouts/{rid}/finish", json=body)
        assert done.status_code == 200, done.text
        assert done.json()["status"] == "finished" and done.json()["reward"] is None
        assert "metadata" not in done.json() and not done.json()["final"]
        status, err = api_error(own.get(f"/v1/rollouts/{rid}"))  # the key is spent
        assert status == 401 and "no longer works" in err["message"]
    # Not final: nothing stored until the admin grades it (tests/serving/test_rollouts.py).
    assert not [t for t in env["store"].load() if t.metadata["rollout_id"] == rid]
    assert admin.post(f"/v1/rollouts/{rid}/finish", json={"reward": 0.0}).status_code == 200
    (stored,) = [t for t in env["store"].load() if t.metadata["rollout_id"] == rid]
    assert stored.status == "finished" and stored.reward == 0.0 and stored.hints == []
    assert stored.metadata["expected"] == "secret-answer-17"


def test_rollout_key_on_another_id_gets_the_same_answer_whether_it_exists(env):
    a, b = create(env, "leak-a"), create(env, "leak-b")
    missing = "ro-0123456789abcdef"
    with key_client(env, a) as own:
        for method, suffix, body in (("GET", "", None), ("GET", "/trace", None),
                                     ("POST", "/finish", {}), ("POST", "/finish",
                                                               {"reward": 1.0})):
            answers = []
            for rid in (b["rollout_id"], missing):
                status, err = api_error(own.request(method, f"/v1/rollouts/{rid}{suffix}",
                                                    json=body))
                answers.append((status, err["type"], err["code"], err["param"],
                                err["message"].replace(rid, "<id>")))
            assert answers[0] == answers[1] and answers[0][0] == 404, answers
    assert env["admin"].get(f"/v1/rollouts/{b['rollout_id']}").json()["status"] == "running"
    assert env["admin"].get(f"/v1/rollouts/{a['rollout_id']}").json()["status"] == "running"


def test_sampler_failure_ends_the_rollout_as_infra_error(tmp_path):
    """A sampler that fails (here: SGLang unreachable) is our fault: a 5xx whose
    body names no internal error, and the rollout ends as infra_error (stored,
    key spent), so it is never trained."""

    from ac2_jax.sampling.remote.sglang import SGLangSampler

    dead = refused_url()  # a port nothing listens on
    tok = build_tiny_tokenizer(str(tmp_path / "tok"))
    store = TraceStore(str(tmp_path / "traces.jsonl"))
    app = build_app(SGLangSampler(dead, max_context=MAX_CONTEXT), tok, admin_key=ADMIN,
                    trace_store=store, model_name="tiny")
    url, stop = serve_in_thread(app)
    admin = http_client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    try:
        info = admin.post("/v1/rollouts", json={"task_id": "sampler-down"}).json()
        with pytest.raises(openai.InternalServerError) as e:
            client_for(info).chat.completions.create(model="tiny", messages=[USER], max_tokens=2)
        assert e.value.status_code in (500, 503) and "SGLang" not in e.value.message
        trace = admin.get(f"/v1/rollouts/{info['rollout_id']}/trace").json()
        assert trace["status"] == "infra_error" and trace["reward"] is None
        assert "SGLang" in trace["metadata"]["artifacts"]["error"]  # the admin sees the cause
        assert [t.status for t in store.load()] == ["infra_error"]
        with pytest.raises(openai.AuthenticationError, match="infra_error"):
            client_for(info).chat.completions.create(model="tiny", messages=[USER], max_tokens=2)
        # The admin's own requests belong to no rollout: a 500, nothing to end.
        r = admin.post("/v1/chat/completions", json={"model": "tiny", "messages": [USER]})
        assert r.status_code in (500, 503) and len(store.load()) == 1
    finally:
        admin.close()
        stop()


def test_hostile_bodies_are_refused_openai_shaped_and_change_nothing(env):
    a = create(env, "hostile-a")
    client = client_for(a)
    client.chat.completions.create(model="tiny", messages=[USER], max_tokens=2)
    admin, url = env["admin"], env["url"]

    def snapshot():
        return (admin.get(f"/v1/rollouts/{a['rollout_id']}/trace").json(),
                len(env["store"].load()), len(env["app"].state.registry))

    before = snapshot()
    key = {"Authorization": f"Bearer {a['api_key']}", "Content-Type": "application/json"}
    chat = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2'
    raw_cases = [
        (chat + ', "temperature": NaN}', 400, "invalid_json"),
        (chat + ', "temperature": Infinity}', 400, "invalid_json"),
        ('{"model": "tiny", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}", 400,
         "json_too_deep"),
        ((chat + ', "stop": "\xff"}').encode("latin-1"), 400, "invalid_encoding"),
        (chat + ', "pad": "' + "x" * (9 << 20) + '"}', 413, "request_too_large"),
    ]
    for body, status, code in raw_cases:
        r = http_post(url + "/v1/chat/completions", content=body, headers=key, timeout=300)
        got_status, err = api_error(r)
        assert (got_status, err["code"]) == (status, code), err
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert http_get(url + path).status_code == 404

    for kw, param in (
            ({"extra_body": {"top_k": 2**40}}, "top_k"),
            ({"seed": 2**64}, "seed"),
            ({"n": 1000}, "n"),
            ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
            ({"stop": ["s"] * 17}, "stop"),
            ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
            ({"logit_bias": {"5": 3}}, "logit_bias"),
            ({"presence_penalty": 0.5}, "presence_penalty"),
            ({"frequency_penalty": 0.5}, "frequency_penalty"),
            ({"response_format": {"type": "yaml"}}, "response_format"),
            ({"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
            ({"stream_options": {"include_usage": True}}, "stream_options"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"metadata": {"agent": "x"}}, "metadata.agent")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=[USER], max_tokens=2, **kw)
        assert e.value.param == param and set(e.value.body) == {
            "message", "type", "param", "code"}, (kw, e.value.body)

    # NaN in rollout metadata, metrics or artifacts: refused before anything is stored.
    admin_json = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}
    status, err = api_error(http_post(url + "/v1/rollouts", headers=admin_json,
                                       content='{"task_id": "x", "metadata": {"v": NaN}}'))
    assert status == 400
    for field in ("metrics", "artifacts"):
        status, err = api_error(http_post(
            url + f"/v1/rollouts/{a['rollout_id']}/finish", headers=admin_json,
            content=f'{{"reward": 1.0, "{field}": {{"v": Infinity}}}}'))
        assert status == 400
    assert snapshot() == before
    # The rollout still works and finishes normally.
    assert admin.post(f"/v1/rollouts/{a['rollout_id']}/finish",
                      json={"reward": 1.0}).status_code == 200


def test_a_poisoned_batch_fails_only_the_bad_requests(env):
    """8 good rollouts run beside hostile requests sent at the same time (each from
    its own rollout): the good ones complete and record normally, each bad one
    gets its 4xx and leaves its rollout unchanged."""
    chat = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6'
    hostile = [  # (raw body or openai kwargs, status, param or code)
        ({"extra_body": {"top_k": 2**40}}, 400, "top_k"),
        ({"seed": 2**64}, 400, "seed"),
        ({"logit_bias": {"1": 5}}, 400, "logit_bias"),
        (chat + ', "temperature": NaN}', 400, "invalid_json"),
        ('{"model": "tiny", "messages": ' + "[" * 50_000 + "]" * 50_000 + "}", 400,
         "json_too_deep"),
        ((chat + ', "stop": "\xff"}').encode("latin-1"), 400, "invalid_encoding"),
        (chat + ', "pad": "' + "x" * (9 << 20) + '"}', 413, "request_too_large"),
    ]
    infos = [create(env, f"poison-{i}") for i in range(8 + len(hostile))]

    async def good(info, i):
        client = client_for(info, async_=True)
        try:
            return await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": f"job {i}"}], max_tokens=6,
                temperature=1.0, seed=i)
        finally:
            await client.close()

    async def bad(info, case):
        body, status, what = case
        if isinstance(body, dict):
            client = client_for(info, async_=True)
            try:
                await client.chat.completions.create(model="tiny", messages=[USER],
                                                     max_tokens=6, **body)
            except openai.APIStatusError as e:
                return e.status_code, e.body
            finally:
                await client.close()
            return None
        async with async_http_client(timeout=300) as http:
            r = await http.post(info["base_url"] + "/chat/completions", content=body, headers={
                "Authorization": f"Bearer {info['api_key']}",
                "Content-Type": "application/json"})
        return r.status_code, r.json()["error"]

    async def batch():
        return await asyncio.gather(*(good(info, i) for i, info in enumerate(infos[:8])),
                                    *(bad(info, case) for info, case in zip(infos[8:], hostile)))

    out = asyncio.run(batch())
    for (status, err), (_, want_status, what) in zip(out[8:], hostile):
        assert set(err) == {"message", "type", "param", "code"}
        assert status == want_status and what in (err["param"], err["code"]), err
    for i, (info, resp) in enumerate(zip(infos, out[:8])):
        assert resp.choices[0].finish_reason in ("stop", "length"), resp
        trace = env["admin"].get(f"/v1/rollouts/{info['rollout_id']}/trace").json()
        (episode,) = trace["episodes"]
        assert f"job {i}" in env["tok"].decode(episode["token_ids"])
        check_episode(env, episode)
    for info in infos[8:]:
        status = env["admin"].get(f"/v1/rollouts/{info['rollout_id']}").json()
        assert status["status"] == "running" and status["num_completions"] == 0


def test_streaming_with_the_jax_sampler_equals_the_plain_answer(env):
    info = create(env, "stream-real")
    client = client_for(info)
    _, messages = run_tool_conversation(client, turns=2)
    plain = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                           temperature=0, max_tokens=64, logprobs=True)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=64,
        logprobs=True, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content == TURNS[2][0]
    lps = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs
           for e in c.choices[0].logprobs.content]
    np.testing.assert_allclose(lps, [e.logprob for e in plain.choices[0].logprobs.content],
                               atol=1e-5)
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    # A longer sampled text arrives in several chunks (the sampler hands over tokens
    # every `steps_per_sync` steps), and equals the seeded plain answer.
    kw = dict(model="tiny", prompt="3 + 4 =", max_tokens=40, temperature=1.0, seed=7,
              logprobs=1)
    plain = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert "".join(pieces) == plain.choices[0].text and len(pieces) >= 2
    lps = [x for c in chunks if c.choices and c.choices[0].logprobs
           for x in c.choices[0].logprobs.token_logprobs]
    np.testing.assert_allclose(lps, plain.choices[0].logprobs.token_logprobs, atol=1e-5)
    offsets = [x for c in chunks if c.choices and c.choices[0].logprobs
               for x in c.choices[0].logprobs.text_offset]
    assert offsets == plain.choices[0].logprobs.text_offset
    # top_logprobs are not in on_tokens: they come, all of them, with the final chunk.
    chat_kw = dict(model="tiny", messages=[USER], max_tokens=12, temperature=1.0, seed=3,
                   logprobs=True, top_logprobs=2)
    plain = client.chat.completions.create(**chat_kw)
    entries = [e for c in client.chat.completions.create(stream=True, **chat_kw)
               if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [[t.token for t in e.top_logprobs] for e in entries] == [
        [t.token for t in e.top_logprobs] for e in plain.choices[0].logprobs.content]
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_finished_traces_leave_memory_and_their_status_stays_answerable(env, tmp_path):
    store = TraceStore(str(tmp_path / "evict.jsonl"))
    app = build_app(env["sampler"], env["tok"], admin_key=ADMIN, trace_store=store,
                    model_name="tiny", max_finished_rollouts=3)
    url, stop = serve_in_thread(app)
    try:
        with http_client(base_url=url, timeout=300,
                          headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
            ids = []
            for i in range(12):
                info = admin.post("/v1/rollouts", json={"task_id": f"ev-{i}"}).json()
                client_for(info).chat.completions.create(model="tiny", messages=[USER],
                                                         max_tokens=2)
                admin.post(f"/v1/rollouts/{info['rollout_id']}/finish", json={"reward": i})
                ids.append(info["rollout_id"])
                assert len(app.state.registry) <= 3  # traces in memory stay bounded
            old = admin.get(f"/v1/rollouts/{ids[0]}").json()
            assert old["evicted"] and old["reward"] == 0 and old["num_completions"] == 1
            assert old["status"] == "finished" and "completions" not in old
            stored = store.load()
            assert len(stored) == 12  # every trace is in the store
            back = admin.get(f"/v1/rollouts/{ids[0]}/trace").json()  # read back from it
            assert back == stored[0].to_dict() and back["metadata"]["rollout_id"] == ids[0]
            assert admin.get("/v1/rollouts/ro-0123456789abcdef/trace").status_code == 404
    finally:
        stop()
