"""Rollout lifecycle requests: create/finish bodies and what a rollout key may do."""

import pytest

from ac2_jax.serving.core.errors import APIError
from ac2_jax.serving.lifecycle.rollout_requests import (
    check_json,
    check_rollout_key_finish,
    keys_equal,
    parse_create,
    parse_finish,
)


def test_parse_create_and_finish():
    assert parse_create({"task_id": "t", "group_id": 3, "timeout_s": 2}) == {
        "task_id": "t", "group_id": "3", "timeout_s": 2.0}
    assert parse_finish({"reward": 1}) == {"status": "finished", "reward": 1.0}
    for bad in ({}, {"task_id": ""}, {"task_id": "t", "metadata": []},
                {"task_id": "t", "timeout_s": 0}, {"task_id": "t", "group_id": True}):
        with pytest.raises(APIError):
            parse_create(bad)
    for bad in ([], {"reward": "1"}, {"reward": float("nan")}, {"reward": True},
                {"artifacts": 1}, {"hints": [1]}):
        with pytest.raises(APIError):
            parse_finish(bad)


def test_a_rollout_key_may_only_end_its_rollout_as_finished():
    check_rollout_key_finish(parse_finish({}))
    check_rollout_key_finish(parse_finish({"status": "finished"}))
    for body, field in (({"reward": 1}, "reward"), ({"reward": 0.0}, "reward"),
                        ({"status": "failed"}, "status"), ({"metrics": {"m": 1}}, "metrics"),
                        ({"hints": ["h"]}, "hints"), ({"artifacts": {"a": 1}}, "artifacts"),
                        ({"status": "timed_out", "metrics": {}}, "status")):
        with pytest.raises(APIError, match=f"Only the admin key may set '{field}'") as e:
            check_rollout_key_finish(parse_finish(body))
        assert (e.value.status, e.value.param, e.value.code) == (403, field, "admin_only")
    with pytest.raises(APIError, match="'reward', 'status' to 'failed'"):
        check_rollout_key_finish(parse_finish({"status": "failed", "reward": 1}))


def test_unknown_create_and_finish_fields_are_refused():
    for parse, body, key in ((parse_create, {"task_id": "t", "reward": 1}, "reward"),
                             (parse_finish, {"reward": 1, "score": 2}, "score"),
                             (parse_finish, {"rewards": 1}, "rewards")):
        with pytest.raises(APIError) as e:
            parse(body)
        assert e.value.status == 400 and e.value.param == key


def test_check_json_wants_a_lossless_round_trip():
    check_json({"a": [1, 2.5, "x", None, {"b": True}]}, "metadata")
    for bad in ({"v": float("nan")}, {"v": float("inf")}, {1: "x"}, {"t": (1, 2)}, {"o": object()}):
        with pytest.raises(APIError) as e:
            check_json(bad, "metadata")
        assert e.value.status == 400 and e.value.param == "metadata"


def test_keys_equal():
    assert keys_equal("sk-a", "sk-a") and not keys_equal("sk-a", "sk-b")
