"""The core data objects: Message, Completion, Episode, Trace.

Plain dataclasses with exact JSON round-trips (`to_dict` / `from_dict`), so a
trace stored on disk reads back equal to the one in memory.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import uuid
from typing import Any

from ac2_jax.trace.routing import routing_length


def messages_fingerprint(messages: list[dict[str, Any]]) -> str:
    """sha256 (hex, 16 chars) of a message list's canonical JSON."""
    text = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def new_attempt_id() -> str:
    """A fresh attempt id: two attempts never share a `Trace.key` by default."""
    return uuid.uuid4().hex[:12]


@dataclasses.dataclass
class Message:
    """One OpenAI chat message."""

    role: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Message:
        return cls(
            role=d["role"],
            content=d.get("content"),
            tool_calls=d.get("tool_calls"),
            tool_call_id=d.get("tool_call_id"),
            name=d.get("name"),
        )


@dataclasses.dataclass
class Completion:
    """One request to the model: the tokens it saw and the tokens it sampled.

    `output_logprobs[i]` is the sampler's log-prob of `output_ids[i]` under the
    distribution it sampled from: the logits after `temperature`, `top_k` and
    `top_p` (`ac2_jax.losses.sampling_logits`); the learner applies the same
    parameters when it re-scores these tokens. temperature 0 means greedy (no
    behaviour distribution: RL refuses such tokens). top_k <= 0 / top_p >= 1
    mean off. `cached_tokens` is how many prompt tokens the sampler reused.

    The request's messages are held either whole (`messages`) or, as the
    endpoint records them, as a delta: the full list is the previous
    completion's list (in the same episode) cut to `messages_start` entries,
    plus `messages_delta`; `messages_sha` is the full list's
    `messages_fingerprint`. `Episode.with_messages()` rebuilds full lists.

    `request_id` is the id of the response the endpoint answered the request
    with (`chatcmpl-...`, what the client saw as `response.id`) and
    `choice_index` this completion's index among its n choices: the n
    completions of one request share the id. None where not recorded (older
    stores, traces built by hand).

    `constraint` is the llguidance grammar the output was sampled under (None:
    unconstrained): `output_logprobs` are then log-probs under the grammar's
    mask, which `ac2_jax.sampling.constraints.replay_masks(constraint,
    tokenizer, output_ids)` rebuilds position by position.

    `adapter` names the LoRA adapter the request sampled with (the endpoint's
    `model` "<name>@<adapter>"; None: the served model itself): the learner
    that trains on it must score with the same adapter.

    `routed_experts` (mixture-of-experts samplers): the experts each token of
    prompt_ids + output_ids was routed to, per MoE layer, compactly
    (`trace.routing.encode_routing`); the learner replays them (routing
    replay). None where the sampler records none.

    `output_versions[i]` is the policy version that sampled `output_ids[i]`
    (a sampler that swaps weights mid-generation: `JaxSampler(weight_swap=
    "in_flight")`), its log-prob being that version's; None: every token was
    sampled by `policy_version` (which is otherwise the first token's).
    `token_versions()` gives the per-token list either way.
    """

    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    policy_version: int = 0
    finish_reason: str = "stop"
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    cached_tokens: int = 0
    messages: list[dict[str, Any]] | None = None  # the request, for viewers
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    messages_delta: list[dict[str, Any]] | None = None
    messages_start: int = 0
    messages_sha: str | None = None
    request_id: str | None = None
    choice_index: int = 0
    constraint: str | None = None
    adapter: str | None = None
    routed_experts: str | None = None
    output_versions: list[int] | None = None

    def __post_init__(self):
        if len(self.output_logprobs) != len(self.output_ids):
            raise ValueError(
                f"Completion: output_logprobs has {len(self.output_logprobs)} entries "
                f"but output_ids has {len(self.output_ids)}"
            )
        if self.output_versions is not None and len(self.output_versions) != len(self.output_ids):
            raise ValueError(
                f"Completion: output_versions has {len(self.output_versions)} entries "
                f"but output_ids has {len(self.output_ids)}"
            )
        if self.routed_experts is not None:
            n = len(self.prompt_ids) + len(self.output_ids)
            if routing_length(self.routed_experts) != n:
                raise ValueError(
                    f"Completion: routed_experts covers {routing_length(self.routed_experts)} "
                    f"tokens but prompt_ids + output_ids has {n}"
                )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.messages_sha is None:  # not a delta: as older stores wrote it
            for k in ("messages_delta", "messages_start", "messages_sha"):
                del d[k]
        if self.request_id is None:  # as older stores wrote it
            del d["request_id"], d["choice_index"]
        if self.constraint is None:  # as older stores wrote it
            del d["constraint"]
        if self.adapter is None:  # as older stores wrote it
            del d["adapter"]
        if self.routed_experts is None:  # as older stores wrote it
            del d["routed_experts"]
        if self.output_versions is None:  # as older stores wrote it
            del d["output_versions"]
        return d

    def token_versions(self) -> list[int]:
        """The policy version of each output token (`output_versions`, or
        `policy_version` for every token when that is None)."""
        if self.output_versions is None:
            return [int(self.policy_version)] * len(self.output_ids)
        return [int(v) for v in self.output_versions]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Completion:
        return cls(**d)

    def to_delta(self, previous: list[dict[str, Any]] | None) -> None:
        """Keeps only what `messages` adds to `previous` (the same episode's last
        full list), plus its fingerprint. No-op without messages."""
        full = self.messages
        if full is None:
            return
        start = 0
        if (
            previous is not None
            and len(previous) <= len(full)
            and full[: len(previous)] == previous
        ):
            start = len(previous)
        self.messages, self.messages_delta = None, list(full[start:])
        self.messages_start, self.messages_sha = start, messages_fingerprint(full)


@dataclasses.dataclass
class Episode:
    """An append-only token sequence of one agent conversation.

    `loss_mask[i]` is 1 exactly on tokens the agent generated;
    `sampler_logprobs[i]` is the sampler's log-prob there (0 elsewhere).
    """

    agent: str
    token_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    sampler_logprobs: list[float] = dataclasses.field(default_factory=list)
    completions: list[Completion] = dataclasses.field(default_factory=list)

    @property
    def num_agent_tokens(self) -> int:
        return int(sum(self.loss_mask))

    def messages_at(self) -> list[list[dict[str, Any]] | None]:
        """The full request messages of each completion (None where not recorded),
        rebuilt from deltas; ValueError if a rebuilt list fails its fingerprint."""
        out, full = [], None
        for i, c in enumerate(self.completions):
            if c.messages is not None:
                full = list(c.messages)
            elif c.messages_sha is not None:
                base = full or []
                if c.messages_start > len(base):
                    raise ValueError(
                        f"completion {i}: messages_start {c.messages_start} is past "
                        f"the previous list ({len(base)} messages)"
                    )
                full = base[: c.messages_start] + list(c.messages_delta or [])
                if messages_fingerprint(full) != c.messages_sha:
                    raise ValueError(
                        f"completion {i}: rebuilt messages do not match their fingerprint"
                    )
            else:
                full = None
            out.append(full)
        return out

    def with_messages(self) -> list[Completion]:
        """Copies of the completions, each with its full `messages`."""
        return [
            dataclasses.replace(c, messages=m)
            for c, m in zip(self.completions, self.messages_at(), strict=True)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "agent": self.agent,
            "token_ids": list(self.token_ids),
            "loss_mask": list(self.loss_mask),
            "sampler_logprobs": list(self.sampler_logprobs),
            "completions": [c.to_dict() for c in self.completions],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Episode:
        return cls(
            agent=d["agent"],
            token_ids=list(d["token_ids"]),
            loss_mask=list(d["loss_mask"]),
            sampler_logprobs=list(d["sampler_logprobs"]),
            completions=[Completion.from_dict(c) for c in d.get("completions", [])],
        )


# How an attempt ended (DESIGN.md "Failures"). "finished": the verifier's reward,
# wrong answers included (trained). "agent_error": the agent's own fault, e.g.
# no answer within its step budget (trained, with the verifier's or a configured
# reward). "timed_out": the endpoint's deadline passed (trained or dropped, by
# config). "infra_error": our fault, e.g. a sampler, network or harness crash
# (never trained). "running" until then.
class TraceStatus(enum.StrEnum):
    """The one status vocabulary of a trace (members are the strings stored)."""

    RUNNING = "running"
    FINISHED = "finished"
    AGENT_ERROR = "agent_error"
    TIMED_OUT = "timed_out"
    INFRA_ERROR = "infra_error"

    @classmethod
    def parse(cls, value: Any, what: str = "status") -> TraceStatus:
        """`value` as a status, or a ValueError naming it and the allowed ones."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"{what} must be one of {list(TRACE_STATUSES)}, got {value!r}"
            ) from None


TRACE_STATUSES = tuple(s.value for s in TraceStatus)
# How an attempt may end (everything but running).
END_STATUSES = tuple(s.value for s in TraceStatus if s is not TraceStatus.RUNNING)
# Ends with a verdict on the agent (the environment graded it): results for a mixer.
RESULT_STATUSES = (TraceStatus.FINISHED.value, TraceStatus.AGENT_ERROR.value)


@dataclasses.dataclass
class Trace:
    """One attempt at one task: all its episodes and one task-level outcome."""

    task_id: str
    attempt_id: str = dataclasses.field(default_factory=new_attempt_id)
    group_id: str | None = None
    episodes: list[Episode] = dataclasses.field(default_factory=list)
    reward: float | None = None
    hints: list[str] = dataclasses.field(default_factory=list)
    status: str = "running"
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def key(self) -> str:
        """Unique name of this attempt (the loss's 'task' index groups by it)."""
        return f"{self.task_id}/{self.attempt_id}"

    @property
    def num_agent_tokens(self) -> int:
        return sum(e.num_agent_tokens for e in self.episodes)

    @property
    def events(self) -> list[dict[str, Any]]:
        """The harness's own events of the attempt, in order (e.g. `{"agent": "compactor",
        "kind": "compaction", "memo": ..., "memo_ok": ...}`), as `run_rollout` stores them
        in `metadata["artifacts"]["events"]`; [] when none were stored."""
        return list(((self.metadata or {}).get("artifacts") or {}).get("events") or [])

    def to_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "attempt_id": self.attempt_id,
            "group_id": self.group_id,
            "episodes": [e.to_dict() for e in self.episodes],
            "reward": self.reward,
            "hints": list(self.hints),
            "status": self.status,
            "metrics": dict(self.metrics),
            "metadata": dict(self.metadata),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trace:
        status = TraceStatus.parse(d.get("status", "running"), "Trace.status")
        return cls(
            task_id=d["task_id"],
            attempt_id=d.get("attempt_id") or new_attempt_id(),
            group_id=d.get("group_id"),
            episodes=[Episode.from_dict(e) for e in d.get("episodes", [])],
            reward=d.get("reward"),
            hints=list(d.get("hints", [])),
            status=status.value,
            metrics=dict(d.get("metrics", {})),
            metadata=dict(d.get("metadata", {})),
        )
