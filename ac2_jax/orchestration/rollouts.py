"""Running one task attempt as a rollout of the lifecycle API.

`LifecycleClient` speaks the endpoint's rollout routes over HTTP (admin key):
create a rollout (getting its own base_url and api_key), finish it with a
reward, fetch its token-level trace. `run_rollout` is one attempt end to end:
create, run the orchestrator loop with an OpenAI client bound to the rollout
key, verify, finish. This is how RL collects traces, and how any harness can.
`classify_error` says whose fault a failed attempt was (docs/design.md "Failures").

`openai` is imported only when a rollout runs (`run_rollout` builds its
client): importing this module, and the training packages above it, needs
no openai (a GPU machine that only benchmarks training may lack it).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from typing import Any

import httpx

from ac2_jax.envs.base import AgentError, Env, Task
from ac2_jax.orchestration.base import ConversationTrace, EnvUser, Orchestrator, run_task
from ac2_jax.trace.types import Trace


class LifecycleError(RuntimeError):
    """The endpoint refused a lifecycle call (`status_code`: its HTTP status)."""

    def __init__(self, message: str, status_code: int | None = None):
        super().__init__(message)
        self.status_code = status_code


class LifecycleClient:
    """Async client for /v1/rollouts (create, get, finish, trace) and the admin's
    /v1/models and /v1/admin/load_weights.

    A call that fails on the network (httpx.TransportError: connection refused
    or reset, timeouts) or with HTTP 5xx is tried again, up to `retries` more
    times, after `backoff_s`, 2*`backoff_s`, ...; 4xx answers are final. (A
    retried create whose first try did reach the endpoint leaves an orphan
    rollout there, which its timeout ends.)
    """

    def __init__(
        self,
        base_url: str,
        admin_key: str,
        timeout_s: float = 600.0,
        *,
        retries: int = 2,
        backoff_s: float = 0.1,
    ):
        if retries < 0:
            raise ValueError(f"LifecycleClient: retries must be >= 0, got {retries}")
        self.base_url = base_url.rstrip("/")
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        self.calls = 0  # HTTP requests made, retries included
        self._admin = {"Authorization": f"Bearer {admin_key}"}
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout_s, headers=self._admin
        )
        self._ssl: ssl.SSLContext | None = None

    def rollout_http(self) -> httpx.AsyncClient:
        """A fresh HTTP client for one rollout (`run_rollout` sends its lifecycle
        calls and, through its `openai.AsyncOpenAI`, its model calls over it, then
        closes it), built on one SSL context shared by all of them. Each
        default client built its own context (~35 ms of CPU loading the CA
        bundle, even for http://), and one pool shared by every rollout costs
        O(connections) per request in httpcore: either way the demo's collector
        started ~30 rollouts per second and the sampler sat at ~2 active rows
        of 64 (docs/notes/2026-12-02-rl-loop-sampling.md)."""
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return httpx.AsyncClient(timeout=600.0, verify=self._ssl)

    async def _call(
        self, method: str, path: str, http: httpx.AsyncClient | None = None, **kw
    ) -> dict[str, Any]:
        """One lifecycle call, retried as the class says; over `http` (e.g. the
        rollout's own `rollout_http` client) when given, with this client's admin
        key and timeout, else over the shared client."""
        url = path
        if http is not None:
            url, kw = (
                self.base_url + path,
                {**kw, "headers": self._admin, "timeout": self.timeout_s},
            )
        for i in range(self.retries + 1):
            last = i == self.retries
            self.calls += 1
            try:
                r = await (http or self._http).request(method, url, **kw)
            except httpx.TransportError:
                if last:
                    raise
            else:
                if r.status_code < 400:
                    return r.json()
                if r.status_code < 500 or last:
                    raise LifecycleError(
                        f"{method} {path}: HTTP {r.status_code}: {r.text[:500]}", r.status_code
                    )
            await asyncio.sleep(self.backoff_s * (i + 1))
        raise AssertionError("unreachable")

    async def create(
        self,
        task_id: str,
        group_id: str | None = None,
        metadata: dict | None = None,
        timeout_s: float | None = None,
        *,
        http: httpx.AsyncClient | None = None,
        agent_rules: list[dict] | None = None,
        reward_range: tuple[float, float] | None = None,
    ) -> dict[str, Any]:
        """agent_rules: labels of the rollout's requests that name no agent, by their
        system prompt (the endpoint's `rollout_requests.AgentRule`). reward_range: the
        env's; the endpoint then refuses a finish whose reward is outside it."""
        body: dict[str, Any] = {
            "task_id": task_id,
            "group_id": group_id,
            "metadata": metadata or {},
        }
        if timeout_s is not None:
            body["timeout_s"] = timeout_s  # the endpoint ends it as timed_out after this
        if agent_rules:
            body["agent_rules"] = list(agent_rules)
        if reward_range is not None:
            body["reward_range"] = [float(reward_range[0]), float(reward_range[1])]
        return await self._call("POST", "/v1/rollouts", http, json=body)

    async def get(self, rollout_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/v1/rollouts/{rollout_id}")

    async def finish(
        self,
        rollout_id: str,
        *,
        reward: float | None = None,
        artifacts: dict | None = None,
        status: str | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> dict[str, Any]:
        body = {
            k: v
            for k, v in (("reward", reward), ("artifacts", artifacts), ("status", status))
            if v is not None
        }
        return await self._call("POST", f"/v1/rollouts/{rollout_id}/finish", http, json=body)

    async def trace(self, rollout_id: str, *, http: httpx.AsyncClient | None = None) -> Trace:
        data = await self._call("GET", f"/v1/rollouts/{rollout_id}/trace", http)
        return Trace.from_dict(data.get("trace", data))

    async def models(self) -> dict[str, Any]:
        """The served model's entry of GET /v1/models as the admin sees it
        (policy_version, learner_step, sampler_stats)."""
        return (await self._call("GET", "/v1/models"))["data"][0]

    async def load_weights(self, step: int, learner_step: int | None = None) -> int:
        """Makes the endpoint's sampler load published `step` (POST
        /v1/admin/load_weights); `learner_step`: the loop steps the learner has
        finished. Returns the policy version now served."""
        body: dict[str, Any] = {"step": int(step)}
        if learner_step is not None:
            body["learner_step"] = int(learner_step)
        return int(
            (await self._call("POST", "/v1/admin/load_weights", json=body))["policy_version"]
        )

    async def aclose(self) -> None:
        await self._http.aclose()


def _openai_module():
    """`openai`, imported on first use, or an ImportError naming what to install."""
    try:
        import openai
    except ImportError as e:
        raise ImportError(
            "ac2_jax.orchestration.run_rollout needs the `openai` package: "
            "pip install 'ac2_jax[serve]' (or pip install 'openai>=1.30')"
        ) from e
    return openai


OrchestratorFactory = Callable[[Env, Task, Any, str], Orchestrator]


def classify_error(exc: BaseException) -> str:
    """The trace status of an attempt that raised `exc`: whose fault was it?

    "agent_error" (trained): the agent's own, i.e. a harness or verifier raised
    `AgentError`, the agent's conversation outgrew the model's context
    (HTTP 400 context_length_exceeded), or a model call was refused because the
    rollout's own key had ended the rollout (code rollout_ended_by_key: a policy
    must not escape its grade by ending early). "infra_error" (never trained): ours,
    i.e. everything else: network and connection errors, HTTP 5xx, sampler
    errors, harness or sandbox crashes, and any error not known to be the
    agent's, so that no outage of ours can punish the policy.
    """
    if isinstance(exc, AgentError):
        return "agent_error"
    try:
        import openai
    except ImportError:  # then no openai error can have been raised
        return "infra_error"
    if isinstance(exc, openai.BadRequestError) and exc.code == "context_length_exceeded":
        return "agent_error"
    if isinstance(exc, openai.APIStatusError) and exc.code == "rollout_ended_by_key":
        return "agent_error"
    return "infra_error"


async def run_rollout(
    lifecycle: LifecycleClient,
    env: Env,
    task: Task,
    make_orchestrator: OrchestratorFactory,
    model: str,
    *,
    group_id: str | None = None,
    attempt: int = 0,
    metadata: dict | None = None,
    timeout_s: float | None = None,
) -> tuple[Trace, ConversationTrace]:
    """One attempt: create rollout -> run loop -> verify -> finish -> trace.

    The loop asks the task, and for a multi-turn env (one with `reply`) goes on with
    each of the env's replies to the agent's answers (`EnvUser`): one append-only
    episode; the verifier grades the last answer (awaiting the env's `averify`
    when it has one, e.g. a judge over HTTP, else calling `verify`).

    The attempt ends "finished" when the agent answered (the verifier's reward,
    a wrong answer included), "agent_error" when it did not answer within its
    step or token budget (the verifier's reward for no answer), and otherwise
    as `classify_error` says of the exception (no reward; the error is kept
    in the trace's `metadata["artifacts"]["error"]`); a reward the endpoint refuses
    (outside the env's `reward_range`) is the env's bug: "infra_error", the refusal kept
    as the error. A rollout the endpoint
    ended first (timed_out, or infra_error after a server failure) keeps that
    status. One the harness or policy ended with the rollout key is not final:
    this finish still grades it (the verifier's reward). Errors of the
    lifecycle calls themselves propagate (after `lifecycle`'s own retries).

    `timeout_s`: a wall-clock deadline for the attempt, sent to the endpoint as
    the rollout's timeout and also enforced here: an agent loop still running
    after it is cancelled and the rollout finished as "timed_out" (no reward).
    """
    _openai_module()  # no openai: fail here, before a rollout is created
    if hasattr(env, "env_for"):  # a DomainMixer: the task's own env runs and verifies it
        env = env.env_for(task)
    # One client for all of this rollout's calls (one pooled connection unless its
    # harness makes concurrent model calls): see rollout_http.
    http = lifecycle.rollout_http()
    try:
        return await _run_rollout(
            lifecycle,
            http,
            env,
            task,
            make_orchestrator,
            model,
            group_id,
            attempt,
            metadata,
            timeout_s,
        )
    finally:
        await http.aclose()


def _harness_events(conv: ConversationTrace) -> list[dict]:
    """The harness's own events (compactions with their memo and memo_ok, errors);
    per-request completion events are left out (the episodes hold those)."""
    return [ev for ev in conv.events if ev.get("kind") != "completion"]


async def _run_rollout(
    lifecycle, http, env, task, make_orchestrator, model, group_id, attempt, metadata, timeout_s
) -> tuple[Trace, ConversationTrace]:
    info = await lifecycle.create(
        task.task_id,
        group_id=group_id,
        metadata={"attempt": attempt, "domain": task.domain, **(metadata or {})},
        timeout_s=timeout_s,
        http=http,
        # An env whose harness holds side conversations labels them (CLIAgentEnv).
        agent_rules=getattr(env, "agent_rules", None),
        # The endpoint refuses a finish with a reward outside the env's range.
        reward_range=getattr(env, "reward_range", None),
    )
    # The openai client borrows `http` (closed by run_rollout, after finish and trace).
    client = _openai_module().AsyncOpenAI(
        base_url=info["base_url"],
        api_key=info["api_key"],
        max_retries=0,
        timeout=600.0,
        http_client=http,
    )
    orch, t0 = None, time.monotonic()
    try:
        orch = make_orchestrator(env, task, client, model)
        conv = await asyncio.wait_for(run_task(orch, EnvUser()), timeout_s)
        # An env with `averify` (a judge over HTTP: envs.JudgedEnv) grades without
        # blocking the loop that runs the other attempts.
        averify = getattr(env, "averify", None)
        reward = await averify(task, conv.answer) if averify else env.verify(task, conv.answer)
        status = "finished" if conv.status == "finished" else "agent_error"
        artifacts: dict[str, Any] = {
            "answer": conv.answer,
            "orchestrator_status": conv.status,
            "metrics": conv.metrics,
            "events": _harness_events(conv),
        }
        # An env that scores each turn (`Env.turn_rewards`): recorded for per-turn credit.
        turns = getattr(env, "turn_rewards", None)
        scored = turns(task, conv.messages) if callable(turns) and status == "finished" else None
        if scored is not None:
            artifacts["turn_rewards"] = [float(r) for r in scored]
    except Exception as e:  # noqa: BLE001 - classified and recorded, never leaked
        # A TimeoutError is our deadline only once timeout_s has passed (not one of the harness's).
        deadline = (
            isinstance(e, asyncio.TimeoutError)
            and timeout_s is not None
            and time.monotonic() - t0 >= timeout_s
        )
        status, reward = ("timed_out" if deadline else classify_error(e)), None
        conv = orch.trace if orch is not None else ConversationTrace(task=task)
        conv.status = status
        error = f"deadline of {timeout_s}s passed" if deadline else f"{type(e).__name__}: {e}"
        # What the orchestrator recorded before the failure (its metrics, e.g. the
        # branch choices of a multi-response harness, and its events) reaches the
        # trace whatever the status: without branch_choices RL could not tell which
        # response was continued.
        artifacts = {
            "error": error,
            "orchestrator_status": status,
            "metrics": conv.metrics,
            "events": _harness_events(conv),
        }
    try:
        await lifecycle.finish(
            info["rollout_id"], reward=reward, status=status, artifacts=artifacts, http=http
        )
    except LifecycleError as e:
        if e.status_code == 400 and reward is not None:
            # The endpoint refused the env's reward (outside its reward_range): the env's
            # bug, never a training signal. Finished infra_error with the refusal kept, so
            # the rollout does not stay open on the endpoint.
            conv.status = status = "infra_error"
            artifacts = {**artifacts, "error": f"the env's reward was refused: {e}"}
            artifacts["orchestrator_status"] = status
            await lifecycle.finish(
                info["rollout_id"], reward=None, status=status, artifacts=artifacts, http=http
            )
        elif e.status_code != 409:  # 409: the endpoint ended it first; its status stands
            raise
    trace = await lifecycle.trace(info["rollout_id"], http=http)
    trace.metrics.update(conv.metrics)
    return trace, conv
