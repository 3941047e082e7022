"""RolloutRegistry: keys, recording, finishing, timeouts, all-or-nothing changes."""

import json

import pytest

from ac2_jax.serving.core.errors import APIError
from ac2_jax.serving.lifecycle.rollout_requests import (
    check_rollout_key_finish,
    parse_create,
    parse_finish,
    rollout_key_view,
)
from ac2_jax.serving.lifecycle.rollouts import RolloutRegistry
from ac2_jax.trace import Completion, TraceStore


def comp(prompt, out, version=0):
    return Completion(prompt_ids=prompt, output_ids=out, output_logprobs=[-0.5] * len(out),
                      policy_version=version)


def test_create_gives_unique_ids_keys_and_attempts():
    reg = RolloutRegistry()
    a = reg.create("task", group_id="g", metadata={"x": 1})
    b = reg.create("task", group_id="g")
    assert a.rollout_id != b.rollout_id and a.api_key != b.api_key
    assert a.trace.attempt_id != b.trace.attempt_id  # distinct Trace.key per attempt
    assert a.trace.metadata == {"x": 1, "rollout_id": a.rollout_id}
    assert reg.by_key(a.api_key) is a and reg.get(b.rollout_id) is b
    assert reg.by_key("nope") is None
    with pytest.raises(APIError, match="No rollout") as e:
        reg.get("ro-missing")
    assert e.value.status == 404
    assert reg.create("t", attempt_id="7").trace.key == "t/7"


def test_record_appends_episodes_and_remembers_turns():
    reg = RolloutRegistry()
    r = reg.create("t")
    assert reg.record(r, "main", [comp([1, 2], [3, 4])], [("hi", [], [3, 4])]) == [0]
    assert reg.record(r, "main", [comp([1, 2, 3, 4, 5], [6], version=2)], []) == [0]
    assert reg.record(r, "compactor", [comp([9], [8])], []) == [1]
    assert reg.record(r, "main", [comp([1, 7], [8])], []) == [2]  # rewritten history
    s = reg.summary(r)
    assert s["num_completions"] == 4 and s["num_episodes"] == 3
    assert s["agents"] == ["compactor", "main"] and s["policy_versions"] == [0, 2]
    assert s["completion_tokens"] == 5 and s["agent_tokens"] == 5
    ep = r.trace.episodes[0]
    assert ep.token_ids == [1, 2, 3, 4, 5, 6] and ep.loss_mask == [0, 0, 1, 1, 0, 1]
    assert r.memory.lookup({"role": "assistant", "content": "hi"}) == [3, 4]


def test_finish_stores_the_trace_and_kills_the_key(tmp_path):
    store = TraceStore(str(tmp_path / "traces.jsonl"))
    reg = RolloutRegistry(store)
    r = reg.create("t", group_id="g")
    reg.record(r, "main", [comp([1], [2])], [])
    reg.finish(r, reward=1.5, artifacts={"answer": "42"}, hints=["h"], metrics={"m": 1})
    (stored,) = store.load()
    assert stored.to_dict() == r.trace.to_dict()
    assert stored.status == "finished" and stored.reward == 1.5 and stored.hints == ["h"]
    assert stored.metadata["artifacts"] == {"answer": "42"}
    assert stored.metrics["m"] == 1 and stored.metrics["num_completions"] == 1
    with pytest.raises(APIError, match="no longer works") as e:
        reg.by_key(r.api_key)
    assert e.value.status == 401
    with pytest.raises(APIError, match="already finished") as e:
        reg.finish(r, reward=0.0)
    assert e.value.status == 409
    with pytest.raises(APIError, match="not recorded") as e:
        reg.record(r, "main", [comp([1, 2], [3])], [])
    assert e.value.status == 409
    assert len(store.load()) == 1 and r.trace.reward == 1.5 and len(r.completions) == 1


def test_failed_store_changes_nothing(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    store = TraceStore(str(tmp_path / "ok.jsonl"))
    store.path = str(blocker / "traces.jsonl")  # appending there fails
    reg = RolloutRegistry(store)
    r = reg.create("t")
    before = r.trace.to_dict()
    with pytest.raises(OSError):
        reg.finish(r, reward=1.0, artifacts={"a": 1})
    assert r.trace.to_dict() == before and r.running
    assert reg.by_key(r.api_key) is r


def test_timeout_sweep_finishes_as_timed_out(tmp_path):
    store = TraceStore(str(tmp_path / "t.jsonl"))
    reg = RolloutRegistry(store, default_timeout_s=10.0)
    late = reg.create("t")
    fresh = reg.create("t", timeout_s=1000.0)
    assert reg.sweep(now=late.started + 5) == []
    assert reg.sweep(now=late.started + 11) == [late]
    assert late.status == "timed_out" and fresh.running
    assert [t.status for t in store.load()] == ["timed_out"]
    with pytest.raises(APIError, match="timed_out"):
        reg.by_key(late.api_key)


def test_bad_status_is_rejected_without_change():
    reg = RolloutRegistry()
    r = reg.create("t")
    with pytest.raises(APIError, match="status"):
        reg.finish(r, status="done")
    assert r.running


def test_rollout_key_view_hides_what_the_admin_writes():
    reg = RolloutRegistry()
    r = reg.create("t", metadata={"expected": "42"})
    reg.record(r, "main", [comp([1], [2])], [])
    trace, summary = reg.trace_dict(r), reg.summary(r)
    for full in (trace, summary):
        view = rollout_key_view(full)
        assert "metadata" not in view and "hints" not in view and "metrics" not in view
        assert view == {k: v for k, v in full.items() if k not in ("metadata", "hints",
                                                                   "metrics")}
    assert trace["metadata"]["expected"] == "42"  # the admin's view is untouched


def test_end_statuses_are_the_failure_taxonomy_and_others_are_refused(tmp_path):
    store = TraceStore(str(tmp_path / "t.jsonl"))
    reg = RolloutRegistry(store)
    for status in ("finished", "agent_error", "timed_out", "infra_error"):
        reg.finish(reg.create("t"), status=status)
    assert [t.status for t in store.load()] == ["finished", "agent_error", "timed_out",
                                                "infra_error"]
    # "failed" (an old harness's word) and anything else: a 400 naming the field, and the
    # rollout stays open (nothing stored for it)
    for bad in ("failed", "crashed", "running"):
        r = reg.create("t")
        with pytest.raises(APIError, match="infra_error") as err:
            reg.finish(r, status=bad)
        assert err.value.status == 400 and err.value.param == "status"
    assert len(store.load()) == 4


# -- A rollout ended by its own key (issue 12 item 6 follow-up): the key stops
# sampling, the admin still grades it once; only that grade (or the server's own
# end: timeout, infra error) is final and stored.

def key_end(reg, r, body=None):
    """What the finish route does for a rollout key."""
    args = parse_finish(body or {})
    check_rollout_key_finish(args)
    return reg.finish(r, **args)


def test_a_rollout_ended_by_its_key_stops_sampling_and_the_admin_grades_it_once(tmp_path):
    store = TraceStore(str(tmp_path / "t.jsonl"))
    reg = RolloutRegistry(store)
    r = reg.create("t", group_id="g")
    reg.record(r, "main", [comp([1], [2])], [])
    key_end(reg, r)
    assert r.status == "finished" and r.trace.reward is None and not r.final
    assert store.load() == []  # not graded yet: nothing stored
    s = reg.summary(r)
    assert s["ended_by_key"] and not s["final"] and s["reward"] is None
    with pytest.raises(APIError, match="ended its own rollout") as e:
        reg.by_key(r.api_key)
    assert (e.value.status, e.value.code) == (401, "rollout_ended_by_key")
    with pytest.raises(APIError, match="ended by its own key") as e:  # a request in flight
        reg.record(r, "main", [comp([1, 2], [3])], [])
    assert (e.value.status, e.value.code) == (409, "rollout_ended_by_key")
    with pytest.raises(APIError) as e:  # ended once is enough
        key_end(reg, r)
    assert e.value.status == 409

    reg.finish(r, reward=0.0, metrics={"accuracy": 0.0}, hints=["h"])
    (stored,) = store.load()
    assert stored.to_dict() == r.trace.to_dict() and r.final
    assert stored.status == "finished" and stored.reward == 0.0 and stored.hints == ["h"]
    assert stored.metrics["accuracy"] == 0.0 and stored.metrics["num_completions"] == 1
    assert stored.metrics["ended_by_key_s"] <= stored.metrics["wall_time_s"]
    before = r.trace.to_dict()
    with pytest.raises(APIError, match="already finished") as e:
        reg.finish(r, reward=1.0)
    assert e.value.status == 409
    assert r.trace.to_dict() == before and len(store.load()) == 1
    with pytest.raises(APIError, match="no longer works"):
        reg.by_key(r.api_key)


def test_a_failed_store_leaves_a_key_ended_rollout_gradeable(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    store = TraceStore(str(tmp_path / "ok.jsonl"))
    reg = RolloutRegistry(store)
    r = reg.create("t")
    key_end(reg, r)
    before = r.trace.to_dict()
    store.path = str(blocker / "traces.jsonl")
    with pytest.raises(OSError):
        reg.finish(r, reward=0.0)
    assert r.trace.to_dict() == before and not r.final
    store.path = str(tmp_path / "ok.jsonl")
    reg.finish(r, reward=0.0)
    assert [t.reward for t in store.load()] == [0.0]


def test_a_key_ended_rollout_nobody_grades_times_out(tmp_path):
    store = TraceStore(str(tmp_path / "t.jsonl"))
    reg = RolloutRegistry(store, default_timeout_s=10.0)
    r = reg.create("t")
    key_end(reg, r)
    assert reg.sweep(now=r.started + 5) == [] and store.load() == []
    assert reg.sweep(now=r.started + 11) == [r]
    assert r.final and [(t.status, t.reward) for t in store.load()] == [("timed_out", None)]
    with pytest.raises(APIError, match="already timed_out"):
        reg.finish(r, reward=1.0)
    assert len(store.load()) == 1


def test_over_http_a_policy_that_ends_its_rollout_early_is_still_graded(tmp_path):
    """Real FastAPI over HTTP, the official openai client with the rollout key."""
    import httpx
    import openai
    from flax import nnx

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.sampling.engine.jax_sampler import JaxSampler
    from ac2_jax.serving.app import build_app
    from ac2_jax.serving.server import serve_in_thread
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(str(tmp_path / "tok"))
    cfg = DecoderConfig.tiny(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                             num_heads=2, num_kv_heads=1, head_dim=16,
                             max_position_embeddings=128)
    sampler = JaxSampler(Decoder(cfg, rngs=nnx.Rngs(0)), max_context=128, max_batch=4,
                         min_batch=4, min_cache_len=128, eos_token_ids=tok.stop_token_ids,
                         tokenizer=tok, seed=0)
    store = TraceStore(str(tmp_path / "traces.jsonl"))
    url, stop = serve_in_thread(build_app(sampler, tok, admin_key="sk-admin", model_name="tiny",
                                          trace_store=store))
    admin = httpx.Client(base_url=url, headers={"Authorization": "Bearer sk-admin"}, timeout=120)
    try:
        info = admin.post("/v1/rollouts", json={"task_id": "quits", "group_id": "g"}).json()
        rid = info["rollout_id"]
        policy = openai.OpenAI(base_url=info["base_url"], api_key=info["api_key"],
                               max_retries=0, timeout=120)
        ask = dict(model="tiny", messages=[{"role": "user", "content": "Say 17."}],
                   max_tokens=3, temperature=1.0)
        policy.chat.completions.create(**ask)

        # The policy ends its own rollout early, hoping to escape its grade.
        ended = policy.post(f"/rollouts/{rid}/finish", body={}, cast_to=object)
        assert ended["status"] == "finished" and ended["reward"] is None
        assert ended["ended_by_key"] and not ended["final"]
        assert store.load() == []
        # Its key can no longer sample, nor end the rollout again: a clear 401.
        with pytest.raises(openai.AuthenticationError, match="ended its own rollout") as e:
            policy.chat.completions.create(**ask)
        assert e.value.status_code == 401 and e.value.code == "rollout_ended_by_key"
        assert "admin" in str(e.value)  # says what happens next: the admin grades it
        with pytest.raises(openai.AuthenticationError):
            policy.post(f"/rollouts/{rid}/finish", body={}, cast_to=object)
        s = admin.get(f"/v1/rollouts/{rid}").json()
        assert s["num_completions"] == 1 and not s["final"] and s["reward"] is None

        # The admin grades it with the verifier's reward, once.
        graded = admin.post(f"/v1/rollouts/{rid}/finish",
                            json={"reward": 0.0, "artifacts": {"answer": "nope"}})
        assert graded.status_code == 200, graded.text
        assert graded.json()["status"] == "finished" and graded.json()["reward"] == 0.0
        assert graded.json()["final"]
        trace = admin.get(f"/v1/rollouts/{rid}/trace").json()
        assert trace["status"] == "finished" and trace["reward"] == 0.0
        (stored,) = store.load()
        assert stored.to_dict() == trace and stored.metadata["artifacts"] == {"answer": "nope"}
        assert len(stored.episodes[0].completions) == 1

        again = admin.post(f"/v1/rollouts/{rid}/finish", json={"reward": 1.0})
        assert again.status_code == 409 and again.json()["error"]["code"] == "rollout_finished"
        assert admin.get(f"/v1/rollouts/{rid}/trace").json() == trace
        assert [t.to_dict() for t in store.load()] == [trace]
    finally:
        admin.close()
        stop()
        sampler.close()


def test_nan_or_non_json_metadata_is_refused_before_anything_changes(tmp_path):
    store = TraceStore(str(tmp_path / "t.jsonl"))
    reg = RolloutRegistry(store)
    for bad in ({"v": float("nan")}, {"v": float("inf")}, {"v": object()}, {1: "int key"}):
        with pytest.raises(APIError) as e:
            parse_create({"task_id": "t", "metadata": bad})
        assert e.value.status == 400 and e.value.param == "metadata"
        with pytest.raises(APIError):
            reg.create("t", metadata=bad)
    assert len(reg) == 0
    r = reg.create("t")
    for field in ("metrics", "artifacts"):
        with pytest.raises(APIError) as e:
            parse_finish({field: {"v": float("nan")}})
        assert e.value.param == field
        with pytest.raises(APIError):
            reg.finish(r, reward=1.0, **{field: {"v": float("-inf")}})
    assert r.running and store.load() == []
    reg.finish(r, reward=1.0)
    assert [t.reward for t in store.load()] == [1.0]


def test_finished_rollouts_are_evicted_to_a_small_summary(tmp_path):
    reg = RolloutRegistry(TraceStore(str(tmp_path / "t.jsonl")), max_finished=2,
                          max_summaries=5)
    ids = []
    for i in range(10):
        r = reg.create("t")
        reg.record(r, "main", [comp([1, 2], [3])], [])
        reg.count(r, "aborted_completions")
        reg.finish(r, reward=float(i))
        ids.append(r.rollout_id)
        assert len(reg) <= 2
    assert reg.evicted_summary(ids[-1]) is None  # still whole in memory
    small = reg.evicted_summary(ids[-3])
    assert small["evicted"] and small["reward"] == 7.0 and small["num_completions"] == 1
    assert small["aborted_completions"] == 1 and "completions" not in small
    assert reg.evicted_summary(ids[0]) is None  # past max_summaries: only in the store
    with pytest.raises(APIError) as e:
        reg.get(ids[0])
    assert e.value.status == 404
    assert len(TraceStore(str(tmp_path / "t.jsonl")).load()) == 10


def test_counters_show_in_the_summary_and_the_stored_metrics(tmp_path):
    store = TraceStore(str(tmp_path / "t.jsonl"))
    reg = RolloutRegistry(store)
    r = reg.create("t")
    reg.count(r, "aborted_completions", 2)
    reg.count(r, "sampler_errors")
    s = reg.summary(r)
    assert (s["aborted_completions"], s["sampler_errors"], s["server_errors"]) == (2, 1, 0)
    reg.finish(r, status="infra_error")
    (t,) = store.load()
    assert t.metrics["aborted_completions"] == 2 and t.metrics["sampler_errors"] == 1


def test_recorded_messages_are_deltas_so_a_long_episode_grows_linearly():
    def stored_size(turns):
        reg = RolloutRegistry()
        r = reg.create("t")
        messages, tokens = [{"role": "system", "content": "s" * 300}], [1]
        for i in range(turns):
            messages = messages + [{"role": "user", "content": f"turn {i} " + "u" * 300}]
            prompt = tokens + [2, 3]
            c = comp(prompt, [4, 5])
            c.messages = list(messages)
            reg.record(r, "main", [c], [])
            tokens = prompt + [4, 5]
            messages = messages + [{"role": "assistant", "content": f"reply {i}"}]
        trace = reg.trace_dict(r)
        (ep,) = reg.get(r.rollout_id).trace.episodes
        assert ep.messages_at()[-1] == messages[:-1]  # the last request, rebuilt whole
        return len(json.dumps(trace))

    s0, s10, s20 = stored_size(1), stored_size(10), stored_size(20)
    assert (s20 - s10) < 1.3 * (s10 - s0)  # linear: quadratic would be ~3x


def test_a_reward_outside_the_rollouts_named_range_is_refused(tmp_path):
    """Issue 68, finding 10: /finish stored a reward of 2.0 outside the env's range. A
    rollout created with the env's `reward_range` (run_rollout sends Env.reward_range)
    refuses a reward outside it (400 naming the range, the rollout unchanged); one
    created without takes any finite reward. Real FastAPI over HTTP."""
    import httpx
    from flax import nnx

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.sampling.engine.jax_sampler import JaxSampler
    from ac2_jax.serving.app import build_app
    from ac2_jax.serving.server import serve_in_thread
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(str(tmp_path / "tok"))
    cfg = DecoderConfig.tiny(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                             num_heads=2, num_kv_heads=1, head_dim=16,
                             max_position_embeddings=64)
    sampler = JaxSampler(Decoder(cfg, rngs=nnx.Rngs(0)), max_context=64, max_batch=1,
                         eos_token_ids=tok.stop_token_ids, tokenizer=tok, seed=0)
    url, stop = serve_in_thread(build_app(sampler, tok, admin_key="sk-admin", model_name="tiny"))
    admin = httpx.Client(base_url=url, headers={"Authorization": "Bearer sk-admin"}, timeout=60)
    try:
        ranged = admin.post("/v1/rollouts", json={"task_id": "t", "reward_range": [0.0, 1.0]})
        assert ranged.status_code == 200, ranged.text
        rid = ranged.json()["rollout_id"]
        bad = admin.post(f"/v1/rollouts/{rid}/finish", json={"reward": 2.0})
        assert bad.status_code == 400, bad.text
        err = bad.json()["error"]
        assert err["param"] == "reward" and "outside the rollout's reward_range [0.0, 1.0]" in (
            err["message"])
        assert not admin.get(f"/v1/rollouts/{rid}").json()["final"]  # unchanged
        ok = admin.post(f"/v1/rollouts/{rid}/finish", json={"reward": 1.0})
        assert ok.status_code == 200 and ok.json()["reward"] == 1.0
        trace = admin.get(f"/v1/rollouts/{rid}/trace").json()
        assert trace["metadata"]["reward_range"] == [0.0, 1.0]
        for body in ({"reward_range": [1.0, 0.0]}, {"reward_range": [0.0]}):
            refused = admin.post("/v1/rollouts", json={"task_id": "t", **body})
            assert refused.status_code == 400 and "reward_range" in refused.text
        free = admin.post("/v1/rollouts", json={"task_id": "t"}).json()["rollout_id"]
        assert admin.post(f"/v1/rollouts/{free}/finish", json={"reward": 2.0}).status_code == 200
    finally:
        admin.close()
        stop()
        sampler.close()


def test_policy_versions_count_every_token_of_an_in_flight_generation(tmp_path):
    """A generation that spans in-flight weight updates (Completion.output_versions)
    was sampled by each of its tokens' versions: the rollout's status and its stored
    metrics list them all, not only the first token's (issue 65 review)."""
    store = TraceStore(str(tmp_path / "traces.jsonl"))
    reg = RolloutRegistry(store)
    r = reg.create("t")
    spanning = Completion(prompt_ids=[1], output_ids=[2, 3, 4], output_logprobs=[-0.5] * 3,
                          policy_version=2, output_versions=[2, 3, 5])
    reg.record(r, "main", [spanning, comp([1], [7], version=1)], [])
    assert reg.summary(r)["policy_versions"] == [1, 2, 3, 5]
    reg.finish(r, reward=1.0)
    assert store.load()[0].metrics["policy_versions"] == [1, 2, 3, 5]
