"""Rollout lifecycle requests: create/finish bodies, what a rollout key may do and see.

`parse_create` / `parse_finish` validate bodies for `RolloutRegistry.create`
/ `finish` (400 naming the field; unknown fields and values that are not
strict JSON are refused, so nothing stored can later fail to serialise).
A rollout key may only end its own rollout as "finished"
(`check_rollout_key_finish`) and reads it without the admin's fields
(`rollout_key_view`).
"""

from __future__ import annotations

import hmac
import json
import math
from typing import Any

from ac2_jax.serving.errors import APIError, bad_request

# What only the admin may write when finishing (a rollout key may only end its
# rollout as "finished"), and so what a rollout key is never shown.
ADMIN_ONLY_FINISH_FIELDS = ("reward", "status", "metrics", "hints", "artifacts")
ADMIN_ONLY_VIEW_FIELDS = ("metadata", "hints", "metrics")
CREATE_FIELDS = ("task_id", "group_id", "attempt_id", "metadata", "timeout_s")
FINISH_FIELDS = ("status", "reward", "artifacts", "metrics", "hints")


def _known_fields(body: dict, known: tuple[str, ...]) -> None:
    for key in body:
        if key not in known:
            raise bad_request(f"Field '{key}' is unknown (expected some of {list(known)})",
                              param=key, code="unsupported_field")


def parse_create(body: Any) -> dict[str, Any]:
    """Validated arguments of `RolloutRegistry.create` from a JSON body."""
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    _known_fields(body, CREATE_FIELDS)
    task_id = body.get("task_id")
    if not isinstance(task_id, str) or not task_id:
        raise bad_request("'task_id' is required (a non-empty string)", param="task_id")
    out: dict[str, Any] = {"task_id": task_id}
    for key in ("group_id", "attempt_id"):
        if body.get(key) is not None:
            if not isinstance(body[key], (str, int)) or isinstance(body[key], bool):
                raise bad_request(f"'{key}' must be a string", param=key)
            out[key] = str(body[key])
    if body.get("metadata") is not None:
        if not isinstance(body["metadata"], dict):
            raise bad_request("'metadata' must be an object", param="metadata")
        check_json(body["metadata"], "metadata")
        out["metadata"] = body["metadata"]
    if body.get("timeout_s") is not None:
        t = body["timeout_s"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise bad_request("'timeout_s' must be a number > 0", param="timeout_s")
        out["timeout_s"] = float(t)
    return out


def parse_finish(body: Any) -> dict[str, Any]:
    """Validated arguments of `RolloutRegistry.finish` from a JSON body."""
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object")
    _known_fields(body, FINISH_FIELDS)
    out: dict[str, Any] = {"status": body.get("status") or "finished"}
    reward = body.get("reward")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(
                reward):
            raise bad_request("'reward' must be a finite number", param="reward")
        out["reward"] = float(reward)
    for key, typ, what in (("artifacts", dict, "an object"), ("metrics", dict, "an object"),
                           ("hints", list, "a list of strings")):
        if body.get(key) is not None:
            if not isinstance(body[key], typ):
                raise bad_request(f"'{key}' must be {what}", param=key)
            check_json(body[key], key)
            out[key] = body[key]
    if "hints" in out and not all(isinstance(h, str) for h in out["hints"]):
        raise bad_request("'hints' must be a list of strings", param="hints")
    return out


def check_rollout_key_finish(args: dict[str, Any]) -> None:
    """403 unless `args` (from `parse_finish`) only end the rollout as "finished";
    if they do, marks them `by_rollout_key` for `RolloutRegistry.finish`.

    A rollout key is held by the harness, so often by the policy being
    trained: it may end its own rollout, never grade it. The reward, another
    status, metrics, hints and artifacts come from the admin key, whose finish
    still grades a rollout its key ended.
    """
    refused = [f for f in ADMIN_ONLY_FINISH_FIELDS
               if (args.get("status") != "finished" if f == "status" else f in args)]
    if refused:
        what = ", ".join(f"'status' to {args['status']!r}" if f == "status" else f"'{f}'"
                         for f in refused)
        raise APIError(403, f"Only the admin key may set {what}; a rollout key may only end "
                       "its own rollout, with an empty body or {\"status\": \"finished\"}. "
                       "Send the reward, status, metrics, hints and artifacts with the admin "
                       "key", param=refused[0], code="admin_only")
    args["by_rollout_key"] = True


def rollout_key_view(data: dict[str, Any]) -> dict[str, Any]:
    """A summary or trace dict as its rollout key sees it: without the metadata
    (the admin's, artifacts included), hints and metrics."""
    return {k: v for k, v in data.items() if k not in ADMIN_ONLY_VIEW_FIELDS}


def check_json(value: Any, param: str) -> None:
    """400 naming `param` unless `value` is strict JSON that reads back equal
    (finite numbers, string keys, lists): what the trace store writes, so a
    finish can never fail on it nor store something else."""
    try:
        same = json.loads(json.dumps(value, allow_nan=False)) == value
    except (TypeError, ValueError) as e:
        raise bad_request(f"'{param}' must be JSON with finite numbers: {e}",
                          param=param) from None
    if not same:
        raise bad_request(f"'{param}' does not survive a JSON round trip (keys must be "
                          "strings, sequences lists)", param=param)


def keys_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
