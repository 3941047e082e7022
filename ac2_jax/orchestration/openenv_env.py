"""OpenEnv environments (`pip install 'ac2_jax[openenv]'`), trained unchanged.

`--env=openenv:<url or module>[,key=value...]` plays an OpenEnv environment server:

- a URL (`http://`, `https://`, `ws://` or `wss://`) of a running server; or
- a module `pkg.module[:attr]` whose `attr` (default `app`) is the FastAPI app the
  library's own `create_app(EnvironmentClass, ActionClass, ObservationClass)` builds
  (what `openenv init` generates as `server/app.py`): the adapter serves it with
  uvicorn on a free localhost port, in a thread of this process, for as long as the
  process runs (or until `close()`).

The protocol is the library's own (`openenv.core.env_client.EnvClient`,
`openenv.core.env_server.http_server`): an episode is a WebSocket session on `/ws`
(messages `{"type": "reset" | "step" | "close", "data": ...}`, answers
`{"type": "observation", "data": {"observation", "reward", "done"}}` or
`{"type": "error", "data": {"message", "code"}}`). The server's HTTP `/reset` and
`/step` build a fresh environment per request (no episode lasts across them), so only
`/ws` is used for play; `GET /health` checks the server when the env is built and
`GET /schema` gives the action's and observation's JSON schemas.

Multi-turn path (c), the `gym:` adapter's shape: the task is a reset seed, the prompt
the reset observation as text and what the action takes; each answer of the agent is
one `step` whose action's text field (the action's one required string field, or
`action_field=`) is the answer, and `reply` is the next observation, None once the
env says `done` (or after `max_turns` steps). `reply` replays: it opens a session,
resets with the task's seed and steps every answer so far, so it is a pure function of
the task and the conversation (a recorded attempt replays); the replayed reset
observation must be the one the task was sampled with, else the env does not replay
from its seed and the attempt is an error, never a silent other episode.

The reward is the environment's own: the sum of its step rewards over the attempt's
answers (a step reward of None adds 0; the harness records every answer). Any
failure of the server (unreachable, an error frame, a closed session, a timeout) is
`OpenEnvError`, so the attempt ends `infra_error`, never a reward. Task ids are
`<env name>-<split>-<seed>` (the name from the server's `/metadata`): train seeds
even, eval seeds odd. The observation's text is its one string field (or
`obs_field=`), else the observation as JSON.

Spec keys: `max_turns` (int), `action_field`, `obs_field` (str), `reward_range`
(JSON `[low, high]`, default unbounded), `timeout_s` (per message, default 60).
"""

from __future__ import annotations

import atexit
import difflib
import importlib
import json
import threading
import time
from typing import Any

import httpx

from ac2_jax.envs.base import Env, Task
from ac2_jax.extras import require
from ac2_jax.orchestration._replay import episode_seeds, policy_answers
from ac2_jax.orchestration.gym_env import GymHarness

__all__ = ["OpenEnvEnv", "OpenEnvError", "openenv_env"]

EXTRA = "openenv"
SCHEMES = ("http://", "https://", "ws://", "wss://")
SPEC_KEYS = ("max_turns", "action_field", "obs_field", "reward_range", "timeout_s")
# Fields every OpenEnv Action / Observation carries (openenv.core.env_server.types).
_BASE_FIELDS = {"metadata", "done", "reward"}


class OpenEnvError(RuntimeError):
    """The OpenEnv server failed (unreachable, an error frame, a closed session, a
    timeout): the attempt is infra_error, never scored."""


def _http_base(url: str) -> str:
    url = url.rstrip("/")
    if url.startswith("ws://"):
        return "http://" + url[len("ws://") :]
    if url.startswith("wss://"):
        return "https://" + url[len("wss://") :]
    return url


def _ws_url(base: str) -> str:
    scheme, rest = base.split("://", 1)
    return f"{'wss' if scheme == 'https' else 'ws'}://{rest}/ws"


class _Served:
    """A FastAPI app served by uvicorn in a daemon thread on a free localhost port."""

    def __init__(self, app: Any, what: str, startup_timeout_s: float = 60.0):
        uvicorn = require("uvicorn", EXTRA, what="the openenv env adapter")
        import asyncio

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        self._server = uvicorn.Server(config)
        errors: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(self._server.serve())
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        self._thread = threading.Thread(target=run, name=f"openenv-{what}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self._server.started:
            if errors or not self._thread.is_alive():
                raise ValueError(f"serving {what} failed: {errors[0] if errors else 'exited'}")
            if time.monotonic() > deadline:
                self.stop()
                raise ValueError(f"serving {what}: not started after {startup_timeout_s} s")
            time.sleep(0.02)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.users = 0  # the envs using it: the last to release it stops it
        atexit.register(self.stop)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._server.should_exit

    def release(self) -> None:
        self.users -= 1
        if self.users <= 0:
            self.stop()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


class _Session:
    """One episode: a WebSocket session on the server's `/ws` (the library's protocol)."""

    def __init__(self, env: OpenEnvEnv):
        client = require("websockets.sync.client", EXTRA, what="the openenv env adapter")
        self.env = env
        try:
            self.ws = client.connect(
                env.ws_url, open_timeout=env.timeout_s, max_size=None, proxy=None
            )
        except Exception as e:  # noqa: BLE001 - the one line the attempt keeps
            raise OpenEnvError(
                f"no OpenEnv server answers at {env.url} ({type(e).__name__}: {e})"
            ) from e

    def send(self, kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """The `data` of the server's observation for a reset or step message."""
        try:
            self.ws.send(json.dumps({"type": kind, "data": data}))
            raw = self.ws.recv(timeout=self.env.timeout_s)
        except TimeoutError as e:
            raise OpenEnvError(
                f"{self.env.name} at {self.env.url}: no answer to {kind} within "
                f"{self.env.timeout_s} s"
            ) from e
        except Exception as e:  # noqa: BLE001 - a closed session, a network error
            raise OpenEnvError(
                f"{self.env.name} at {self.env.url}: {kind} failed ({type(e).__name__}: {e})"
            ) from e
        message = json.loads(raw)
        data = message.get("data") or {}
        if message.get("type") == "error":
            raise OpenEnvError(
                f"{self.env.name} at {self.env.url}: {kind} answered error "
                f"{data.get('code', '?')}: {data.get('message', '')}"
                + (f" {json.dumps(data['errors'])}" if data.get("errors") else "")
            )
        if message.get("type") != "observation" or not isinstance(data, dict):
            raise OpenEnvError(
                f"{self.env.name} at {self.env.url}: {kind} answered {raw[:200]!r}, "
                "not an observation"
            )
        return data

    def close(self) -> None:
        """Ends the session and waits for the server to close it (the server frees the
        session's slot before closing: an env of one session takes the next at once)."""
        try:
            self.ws.send(json.dumps({"type": "close"}))
            while True:
                self.ws.recv(timeout=self.env.timeout_s)
        except Exception:  # noqa: BLE001, S110 - ConnectionClosed is the normal end
            pass
        finally:
            self.ws.close()


class OpenEnvEnv(Env):
    """An OpenEnv environment server as a multi-turn text env (module docstring).

    `url`: the server's base URL; `served`: the in-process server behind it, when the
    adapter started one (stopped by `close()`)."""

    def __init__(
        self,
        url: str,
        *,
        max_turns: int | None = None,
        action_field: str | None = None,
        obs_field: str | None = None,
        reward_range: tuple[float, float] = (-1e9, 1e9),
        timeout_s: float = 60.0,
        served: _Served | None = None,
    ):
        # The session client (the openenv extra brings it): a missing one is the extra's hint.
        require("websockets.sync.client", EXTRA, what="the openenv env adapter")
        self.url, self.ws_url = _http_base(url), _ws_url(_http_base(url))
        self.max_turns, self.timeout_s, self._served = max_turns, float(timeout_s), served
        self.reward_range = (float(reward_range[0]), float(reward_range[1]))
        if max_turns is not None and (not isinstance(max_turns, int) or max_turns < 1):
            raise ValueError(f"openenv max_turns must be a positive integer, got {max_turns!r}")
        try:
            health = httpx.get(f"{self.url}/health", timeout=min(self.timeout_s, 10.0))
            health.raise_for_status()
            schema = httpx.get(f"{self.url}/schema", timeout=self.timeout_s).json()
            meta = httpx.get(f"{self.url}/metadata", timeout=self.timeout_s).json()
        except (httpx.HTTPError, ValueError) as e:
            raise ValueError(
                f"no OpenEnv server answers at {self.url} ({type(e).__name__}: "
                f"{' '.join(str(e).split())}); start it (e.g. `uvicorn server.app:app "
                "--port 8000` in the environment's folder) or give its URL"
            ) from None
        self.name = str(meta.get("name") or "openenv")
        self.action_field, self.how = self._action_field(schema.get("action") or {}, action_field)
        self.obs_field = self._obs_field(schema.get("observation") or {}, obs_field)

    def _action_field(self, schema: dict[str, Any], given: str | None) -> tuple[str, str]:
        props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
        required = [k for k in schema.get("required") or [] if k != "metadata"]
        if given is not None:
            if given not in props:
                close = difflib.get_close_matches(given, list(props), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ValueError(
                    f"{self.name}'s action has no field {given!r} (fields: "
                    f"{', '.join(props) or 'none'}){hint}"
                )
            field = given
        else:
            texts = [k for k in required if props[k].get("type") == "string"]
            if len(texts) != 1:
                raise ValueError(
                    f"{self.name}'s action has {len(texts)} required text fields (fields: "
                    f"{', '.join(props) or 'none'}); name the one the answer fills with "
                    "action_field=<name>"
                )
            field = texts[0]
        if props[field].get("type") != "string":
            raise ValueError(
                f"{self.name}'s action field {field!r} is {props[field].get('type')!r}, not "
                "text: the answer fills a string field"
            )
        others = [k for k in required if k != field]
        if others:
            raise ValueError(
                f"{self.name}'s action also requires {', '.join(others)}: the adapter fills "
                f"one text field ({field!r}) with the answer"
            )
        about = props[field].get("description")
        return field, f"Answer with the {field!r} of your action" + (
            f": {about}." if about else "."
        )

    def _obs_field(self, schema: dict[str, Any], given: str | None) -> str | None:
        props = {k: v for k, v in (schema.get("properties") or {}).items() if k not in _BASE_FIELDS}
        if given is not None:
            if given not in props:
                raise ValueError(
                    f"{self.name}'s observation has no field {given!r} (fields: "
                    f"{', '.join(props) or 'none'})"
                )
            return given
        texts = [k for k, v in props.items() if v.get("type") == "string"]
        return texts[0] if len(texts) == 1 else None  # None: the observation as JSON

    def close(self) -> None:
        """Releases the server the adapter started (none for a URL): the last env using
        it stops it."""
        if self._served is not None:
            self._served.release()
            self._served = None

    def text(self, data: dict[str, Any]) -> str:
        """What the agent reads of an observation message's data."""
        obs = data.get("observation") or {}
        if self.obs_field is not None:
            return str(obs.get(self.obs_field, ""))
        shown = {k: v for k, v in obs.items() if k not in _BASE_FIELDS}
        return json.dumps(shown, sort_keys=True)

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        seeds = episode_seeds("OpenEnvEnv", "openenv", self.name, split, seed, n)
        session = _Session(self)
        try:
            tasks = []
            for s in seeds:
                first = self.text(session.send("reset", {"seed": s}))
                tasks.append(Task(
                    task_id=f"{self.name}-{split}-{s}", prompt=f"{first}\n{self.how}",
                    domain=self.name, metadata={"seed": s, "observation": first},
                ))  # fmt: skip
            return tasks
        finally:
            session.close()

    def play(self, task: Task, answers: list[str]) -> tuple[float, bool, str]:
        """(summed step reward, whether the episode ended, the last observation's text)
        after a reset with the task's seed and a step per answer; OpenEnvError when the
        server fails or the env does not replay from its seed."""
        if self.max_turns is not None and len(answers) > self.max_turns:
            raise OpenEnvError(
                f"{task.task_id}: {len(answers)} answers, more than max_turns={self.max_turns}"
            )
        session = _Session(self)
        try:
            text = self.text(session.send("reset", {"seed": int(task.metadata["seed"])}))
            if text != task.metadata["observation"]:
                raise OpenEnvError(
                    f"{self.name} does not replay from its seed: reset(seed="
                    f"{task.metadata['seed']}) gave {text[:80]!r}, the task was sampled with "
                    f"{str(task.metadata['observation'])[:80]!r}"
                )
            total, done = 0.0, False
            for i, answer in enumerate(answers):
                if done:
                    raise OpenEnvError(
                        f"{task.task_id}: answer {i + 1} comes after the episode ended"
                    )
                data = session.send("step", {self.action_field: answer})
                reward = data.get("reward")
                total += 0.0 if reward is None else float(reward)
                done = bool(data.get("done"))
                text = self.text(data)
            return total, done, text
        finally:
            session.close()

    def reply(self, task: Task, messages: list[dict[str, Any]]) -> str | None:
        """The next observation after the agent's last answer; None once the episode
        ended (`done`) or `max_turns` answers were given."""
        answers = policy_answers(messages)
        if not answers:
            return None
        _, done, text = self.play(task, answers)
        if done or (self.max_turns is not None and len(answers) >= self.max_turns):
            return None
        return f"{text}\n{self.how}"

    def verify(self, task: Task, answer: str | None) -> float:
        """The environment's summed step rewards over the recorded answers (the
        harness's JSON record); 0.0 for no answer (no step was taken)."""
        answers = [] if answer is None else json.loads(answer)["answers"]
        return self.play(task, answers)[0] if answers else 0.0

    def make_harness(
        self, task: Task, client, model_name: str, *, sampling=None, max_steps=8
    ) -> GymHarness:
        """The harness the recipes use: the tool loop recording every answer."""
        return GymHarness(self, task, client, model_name, sampling=sampling, max_steps=max_steps)


# The apps this process serves, by id: an app is served once (its sessions' locks belong to
# the event loop of the thread that serves it), shared by every env built on it.
_SERVING: dict[int, _Served] = {}


def _served_app(target: str) -> _Served:
    """Serves the FastAPI app of "pkg.module[:attr]" (attr default `app`), or shares the
    server already serving it; each caller holds one use (`_Served.release`)."""
    module_name, _, attr = target.partition(":")
    attr = attr or "app"
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"cannot import {module_name!r} ({e}); give a running server's URL "
            "(http://host:port) or a module importable from here (run from the folder that "
            "holds the package or put it on PYTHONPATH)"
        ) from None
    app = getattr(module, attr, None)
    if app is None or not callable(app):
        raise ValueError(
            f"{module_name} has no app {attr!r} (the FastAPI app of openenv's "
            "create_app(...)); name it as module:attr"
        )
    served = _SERVING.get(id(app))
    if served is None or not served.alive:
        served = _SERVING[id(app)] = _Served(app, module_name)
    served.users += 1
    return served


def openenv_env(arg: str) -> OpenEnvEnv:
    """The launcher's `--env=openenv:<url or module>[,key=value...]` (values JSON, else
    strings; keys: max_turns, action_field, obs_field, reward_range, timeout_s)."""
    target, *pairs = [p.strip() for p in arg.split(",")]
    if not target:
        raise ValueError(
            "--env=openenv:<url or module>[,key=value...] names no server "
            "(e.g. openenv:http://127.0.0.1:8000 or openenv:echo_env.server.app)"
        )
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = (s.strip() for s in pair.partition("="))
        if not eq or not key:
            raise ValueError(f"--env=openenv:{arg}: {pair!r} is not key=value")
        if key not in SPEC_KEYS:
            close = difflib.get_close_matches(key, SPEC_KEYS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"--env=openenv:{arg}: unknown key {key!r} (keys: {', '.join(SPEC_KEYS)}){hint}"
            )
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    if "reward_range" in kwargs:
        rr = kwargs["reward_range"]
        if not (isinstance(rr, list) and len(rr) == 2):
            raise ValueError(f"--env=openenv:{arg}: reward_range must be [low, high], got {rr!r}")
        kwargs["reward_range"] = (float(rr[0]), float(rr[1]))
    for key in ("action_field", "obs_field"):
        if key in kwargs:
            kwargs[key] = str(kwargs[key])
    if target.startswith(SCHEMES):
        return OpenEnvEnv(target, **kwargs)
    served = _served_app(target)
    try:
        return OpenEnvEnv(served.url, served=served, **kwargs)
    except Exception:
        served.release()
        raise
