"""Rollout lifecycle requests: create/finish bodies, what a rollout key may do and see.

`parse_create` / `parse_finish` / `parse_load_weights` validate bodies (already strict JSON) with
the pydantic models `CreateBody` / `FinishBody` / `LoadWeightsBody` (strict types, unknown
fields forbidden) through `schemas.validate`, the one validation layer of the routes, for
`RolloutRegistry.create` / `finish`: 400 naming the field, and
values that would not round-trip through JSON are refused, so nothing stored
can later fail to serialise.
A rollout key may only end its own rollout as "finished"
(`check_rollout_key_finish`) and reads it without the admin's fields
(`rollout_key_view`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ac2_jax.serving.core.errors import APIError, bad_request
from ac2_jax.serving.core.schemas import MAX_AGENT_LEN, validate, whole

# What only the admin may write when finishing (a rollout key may only end its
# rollout as "finished"), and so what a rollout key is never shown.
ADMIN_ONLY_FINISH_FIELDS = ("reward", "status", "metrics", "hints", "artifacts")
ADMIN_ONLY_VIEW_FIELDS = ("metadata", "hints", "metrics")

# Reported at the field (not at a key or item inside it); `check_json` then checks the values.
Id = Annotated[str | int, whole("must be a string or an integer")] | None
JsonObject = Annotated[dict[str, Any], whole("must be an object with string keys")] | None


class AgentRule(BaseModel):
    """One rule of a rollout's `agent_rules`: a request that names no agent (no X-Agent
    header, no `agent` field) and whose system prompt (the text of its first message,
    when that is a system message) matches is recorded under `agent`.

    system_regex: a Python regular expression searched (`re.search`) in the system
    prompt. system_sha256: a prefix (8 to 64 hex digits) of the SHA-256 of the system
    prompt's UTF-8 text (its fingerprint). At least one; both: both must match."""

    model_config = ConfigDict(extra="forbid", strict=True)
    agent: str = Field(min_length=1, max_length=MAX_AGENT_LEN)
    system_regex: str | None = Field(None, min_length=1, max_length=4096)
    system_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{8,64}$")

    @model_validator(mode="after")
    def _one_test(self) -> AgentRule:
        if self.system_regex is None and self.system_sha256 is None:
            raise ValueError("give system_regex or system_sha256 (or both)")
        if self.system_regex is not None:
            try:
                re.compile(self.system_regex)
            except re.error as e:
                raise ValueError(f"system_regex does not compile: {e}") from None
        return self

    def matches(self, system: str | None) -> bool:
        if system is None:
            return False
        if self.system_sha256 is not None:
            digest = hashlib.sha256(system.encode("utf-8")).hexdigest()
            if not digest.startswith(self.system_sha256):
                return False
        return self.system_regex is None or re.search(self.system_regex, system) is not None


def system_fingerprint(system: str) -> str:
    """The SHA-256 hex digest of a system prompt (what `AgentRule.system_sha256` matches)."""
    return hashlib.sha256(system.encode("utf-8")).hexdigest()


class CreateBody(BaseModel):
    """POST /v1/rollouts (admin)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    task_id: str = Field(min_length=1)
    group_id: Id = None
    attempt_id: Id = None
    metadata: JsonObject = None
    timeout_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    # Labels for requests that name no agent, by their system prompt (first match wins).
    agent_rules: list[AgentRule] | None = Field(None, max_length=64)
    # The env's [low, high] rewards (Env.reward_range): a finish outside it is refused.
    # Without it any finite reward is taken (the endpoint knows no env).
    reward_range: list[float] | None = None

    @model_validator(mode="after")
    def _range(self):
        r = self.reward_range
        if r is not None and (len(r) != 2 or not all(math.isfinite(x) for x in r) or r[0] > r[1]):
            raise ValueError(f"reward_range must be [low, high] finite with low <= high, got {r}")
        return self


class FinishBody(BaseModel):
    """POST /v1/rollouts/{id}/finish (admin; a rollout key: see `check_rollout_key_finish`)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    status: str | None = None
    reward: float | None = Field(None, allow_inf_nan=False)
    artifacts: JsonObject = None
    metrics: JsonObject = None
    hints: Annotated[list[str], whole("must be a list of strings")] | None = None


class LoadWeightsBody(BaseModel):
    """POST /v1/admin/load_weights (admin): the published step to serve, and how
    many loop steps the learner has finished (what a split collector paces on)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    step: int = Field(ge=0)
    learner_step: int | None = Field(None, ge=0)


CREATE_FIELDS = tuple(CreateBody.model_fields)
FINISH_FIELDS = tuple(FinishBody.model_fields)


def parse_create(body: Any) -> dict[str, Any]:
    """Validated arguments of `RolloutRegistry.create` from a JSON body."""
    req = validate(CreateBody, body)
    out: dict[str, Any] = {"task_id": req.task_id}
    for key, value in (("group_id", req.group_id), ("attempt_id", req.attempt_id)):
        if value is not None:
            out[key] = str(value)
    if req.metadata is not None:
        check_json(req.metadata, "metadata")
        out["metadata"] = req.metadata
    if req.agent_rules:
        out["agent_rules"] = list(req.agent_rules)
    if req.timeout_s is not None:
        out["timeout_s"] = float(req.timeout_s)
    if req.reward_range is not None:
        out["reward_range"] = (float(req.reward_range[0]), float(req.reward_range[1]))
    return out


def parse_finish(body: Any) -> dict[str, Any]:
    """Validated arguments of `RolloutRegistry.finish` from a JSON body."""
    req = validate(FinishBody, body)
    out: dict[str, Any] = {"status": req.status or "finished"}
    if req.reward is not None:
        out["reward"] = float(req.reward)
    for key, value in (
        ("artifacts", req.artifacts),
        ("metrics", req.metrics),
        ("hints", req.hints),
    ):
        if value is not None:
            check_json(value, key)
            out[key] = value
    return out


def parse_load_weights(body: Any) -> dict[str, Any]:
    """Validated {step, learner_step} of POST /v1/admin/load_weights (400 naming the field)."""
    req = validate(LoadWeightsBody, body)
    return {"step": req.step, "learner_step": req.learner_step}


def check_rollout_key_finish(args: dict[str, Any]) -> None:
    """403 unless `args` (from `parse_finish`) only end the rollout as "finished";
    if they do, marks them `by_rollout_key` for `RolloutRegistry.finish`.

    A rollout key is held by the harness, so often by the policy being
    trained: it may end its own rollout, never grade it. The reward, another
    status, metrics, hints and artifacts come from the admin key, whose finish
    still grades a rollout its key ended.
    """
    refused = [
        f
        for f in ADMIN_ONLY_FINISH_FIELDS
        if (args.get("status") != "finished" if f == "status" else f in args)
    ]
    if refused:
        what = ", ".join(
            f"'status' to {args['status']!r}" if f == "status" else f"'{f}'" for f in refused
        )
        raise APIError(
            403,
            f"Only the admin key may set {what}; a rollout key may only end "
            'its own rollout, with an empty body or {"status": "finished"}. '
            "Send the reward, status, metrics, hints and artifacts with the admin "
            "key",
            param=refused[0],
            code="admin_only",
        )
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
        raise bad_request(f"'{param}' must be JSON with finite numbers: {e}", param=param) from None
    if not same:
        raise bad_request(
            f"'{param}' does not survive a JSON round trip (keys must be strings, sequences lists)",
            param=param,
        )


def keys_equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
