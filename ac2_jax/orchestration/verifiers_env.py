"""verifiers (`pip install 'ac2_jax[verifiers]'`): a `vf.Environment` trained unchanged.

`VerifiersEnv(vf_env)` serves the environment's own dataset rows as tasks
(its train dataset and its eval dataset; a row is task `<name>-<split>-<row>`),
and its harness runs the environment's own rollout code
(`vf_env.run_rollout`: its multi-turn, tool and stop logic, then its rubric)
with an OpenAI client bound to the rollout (the base URL and key the
lifecycle API gave it), so every request it makes is recorded by the endpoint
as a policy turn. The rubric's score is the reward.

Failures are never rewards: a reward function that raises (verifiers itself
logs it and scores 0) or a rollout that ends with an error (`state["error"]`)
raises `VerifiersError`, so the attempt ends `infra_error`, with no reward,
and is counted with the step's errors. A rollout whose prompt outgrew the
model's context (verifiers' OverlongPromptError) is the agent's
(`AgentError`). Rubrics with group reward functions (scored over a group of
rollouts at once) are refused: attempts here run and finish one by one.

Limits: the environment's own turn limit (`max_turns`) bounds its turns, not
`rollout.max_steps` (a console line says so, once per env and max_steps, when
the two differ; set the environment's `max_turns` argument instead); the
rollout's sampling (temperature, max_tokens, seed) is passed as the
environment's sampling args.

`verifiers_env("<id>[,key=value...]")` (the launcher's `--env=verifiers:...`):
<id> is a class of `verifiers` ("ReasoningGymEnv", "TextArenaEnv", ...), an
installed environment module (`vf.load_environment(id)`), or an import path
"pkg.module:factory" returning a `vf.Environment`; each `key=value` is a keyword
argument (a JSON value, else the string).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import random
import sys
from typing import Any

from ac2_jax.envs.base import AgentError, Env, Task
from ac2_jax.extras import require
from ac2_jax.orchestration.base import Orchestrator

__all__ = ["VerifiersEnv", "VerifiersError", "VerifiersHarness", "verifiers_env"]

EXTRA = "verifiers"


class VerifiersError(RuntimeError):
    """A verifiers rollout or rubric failed (the attempt is infra_error, never scored)."""


def _vf():
    return require("verifiers", EXTRA, what="the verifiers env adapter")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _plain(messages: Any) -> list[dict[str, Any]]:
    """verifiers messages (pydantic models or dicts) as OpenAI-format dicts."""
    out = []
    for m in messages or []:
        d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        out.append({k: v for k, v in d.items() if k in ("role", "content", "tool_calls",
                                                         "tool_call_id", "name")})  # fmt: skip
    return out


class VerifiersEnv(Env):
    """A verifiers environment (module docstring). name: its name in task ids;
    eval_every: when the environment has no eval dataset, 1 in this many train rows
    (by the hash of their prompt) is held out for eval."""

    reward_range = (0.0, 1.0)

    def __init__(self, vf_env: Any, name: str | None = None, *, eval_every: int = 4):
        vf = _vf()
        if not isinstance(vf_env, vf.Environment):
            raise ValueError(
                f"VerifiersEnv: {type(vf_env).__name__} is not a verifiers Environment"
            )
        rubric = vf_env.rubric
        if getattr(rubric, "has_group_rewards", False):
            raise ValueError(
                f"VerifiersEnv: {type(vf_env).__name__}'s rubric has group reward functions "
                "(scored over a group at once); ac2_jax runs and scores attempts one by one"
            )
        self.vf_env = vf_env
        self.name = name or type(vf_env).__name__
        weights = [float(w) for r in _rubrics(rubric) for w in getattr(r, "weights", [])]
        if weights and min(weights) >= 0:
            self.reward_range = (0.0, float(sum(weights)))
        self._watch_rubric()
        train = vf_env.get_dataset()
        evals = vf_env.get_eval_dataset() if vf_env.eval_dataset is not None else None
        rows = [dict(r) for r in train]
        if evals is None:
            held = [self._hash(r) % eval_every == 0 for r in rows]
            self.rows = {
                "train": [(i, r) for i, r in enumerate(rows) if not held[i]],
                "eval": [(i, r) for i, r in enumerate(rows) if held[i]],
            }
        else:
            self.rows = {"train": list(enumerate(rows)),
                         "eval": list(enumerate(dict(r) for r in evals))}  # fmt: skip
        for split, got in self.rows.items():
            if not got:
                raise ValueError(f"VerifiersEnv({self.name}): no {split} rows")

    @staticmethod
    def _hash(row: dict[str, Any]) -> int:
        text = json.dumps(row.get("prompt"), sort_keys=True, default=str)
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")

    def _watch_rubric(self) -> None:
        """Wraps each reward function (of every member of a RubricGroup: `_rubrics`) so
        that an exception it raises (which verifiers logs and scores 0) is recorded on
        the rollout's state ("ac2_rubric_errors"), where the harness finds it and fails
        the attempt. The wrapper shows the
        function's own signature, plus `state` when it names none, so the rubric
        passes the state (and the function still gets only what it asked for)."""
        for rubric in _rubrics(self.vf_env.rubric):
            rubric.funcs = [_watched(f) for f in getattr(rubric, "funcs", [])]

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        if split not in self.rows:
            raise ValueError(f"VerifiersEnv: split must be 'train' or 'eval', got {split!r}")
        pool = self.rows[split]
        rng = random.Random(f"verifiers:{self.name}:{split}:{seed}")
        picks = rng.sample(range(len(pool)), n) if n <= len(pool) else [
            rng.randrange(len(pool)) for _ in range(n)]  # fmt: skip
        tasks = []
        for j, k in enumerate(picks):
            index, row = pool[k]
            prompt = _plain(row.get("prompt"))
            user = [m for m in prompt if m.get("role") == "user"]
            task_id = f"{self.name}-{split}-{index}"
            if n > len(pool):
                task_id += f".{j}"  # drawn again: a distinct group
            tasks.append(Task(
                task_id=task_id, prompt=_text(user[-1]["content"]) if user else "",
                answer=row.get("answer"), domain=self.name,
                metadata={"row": row, "split": split, "index": index},
            ))  # fmt: skip
        return tasks

    def initial_messages(self, task: Task) -> list[dict[str, Any]]:
        return _plain(task.metadata["row"].get("prompt"))

    def verify(self, task: Task, answer: str | None) -> float:
        """The rubric's score that the harness recorded in the answer (a JSON record);
        no answer (no rollout ran): the bottom of reward_range."""
        if answer is None:
            return self.reward_range[0]
        return float(json.loads(answer)["reward"])

    def make_harness(
        self, task: Task, client, model_name: str, *, sampling=None, max_steps=8
    ) -> VerifiersHarness:
        """The harness the recipes use (`recipes.common.harness_factory`). The first
        time a `max_steps` other than the environment's own `max_turns` comes, one
        line on stderr says which applies (nothing silent)."""
        said = self.__dict__.setdefault("_said_max_steps", set())
        if max_steps not in said:
            said.add(max_steps)
            own = getattr(self.vf_env, "max_turns", None)
            own = None if own is None or own <= 0 else int(own)  # <= 0: unlimited
            if own != max_steps:
                turns = "no max_turns (unlimited)" if own is None else f"max_turns={own}"
                print(
                    f"[verifiers] {self.name}: the environment's own {turns} bounds each "
                    f"attempt's turns; rollout.max_steps={max_steps} does not apply (set the "
                    "environment's max_turns argument instead)",
                    file=sys.stderr,
                    flush=True,
                )
        return VerifiersHarness(
            self, task, client, model_name, sampling=sampling, max_steps=max_steps
        )


class VerifiersHarness(Orchestrator):
    """One attempt: the verifiers environment's own rollout and rubric, through the
    rollout's OpenAI client (module docstring)."""

    def __init__(self, env: VerifiersEnv, task: Task, client, model: str, **kw):
        super().__init__(env, task, client, model, **kw)
        self.vf_env_adapter = env

    async def run(self, turn_input: str) -> None:
        vf = _vf()
        from verifiers.clients import OpenAIChatCompletionsClient

        adapter, task = self.vf_env_adapter, self.trace.task
        row = dict(task.metadata["row"])
        sampling = {k: v for k, v in self.sampling.items() if v is not None}
        try:
            output = await adapter.vf_env.run_rollout(
                row, OpenAIChatCompletionsClient(self.client), self.model, sampling,
                state_columns=["ac2_rubric_errors"],
            )  # fmt: skip
        except vf.OverlongPromptError as e:
            raise AgentError(f"verifiers: the prompt outgrew the context ({e})") from e
        errors = output.get("ac2_rubric_errors") or []
        if errors:
            raise VerifiersError(f"{adapter.name}'s rubric failed: {'; '.join(errors)}")
        error = output.get("error")
        if error:
            what = error.get("error") if isinstance(error, dict) else error
            text = " ".join(str(error).split())
            if "Overlong" in str(what):
                raise AgentError(f"verifiers: {text}")
            raise VerifiersError(f"{adapter.name}'s rollout ended with an error: {text}")
        completion = _plain(output.get("completion"))
        self.trace.messages = _plain(row.get("prompt")) + completion
        self.trace.count_step("main", sum(m.get("role") == "assistant" for m in completion))
        last = [m for m in completion if m.get("role") == "assistant"]
        self.trace.answer = json.dumps({
            "reward": float(output["reward"]),
            "metrics": output.get("metrics") or {},
            "answer": _text(last[-1].get("content")) if last else None,
            "stop_condition": output.get("stop_condition"),
        }, default=str)  # fmt: skip
        self.trace.status = "finished"


def _rubrics(rubric: Any) -> list[Any]:
    """The rubrics that hold reward functions: `rubric` itself, or every member of a
    RubricGroup, recursively (verifiers' MultiTurnEnv and ToolEnv add their monitor
    rubrics with `add_rubric`, which makes the env's rubric a group whose own `funcs`
    is empty)."""
    members = getattr(rubric, "rubrics", None)
    if members is None:
        return [rubric]
    return [r for m in members for r in _rubrics(m)]


def _watched(func):
    """`func` wrapped to record what it raises on the state (see `_watch_rubric`)."""
    if getattr(func, "_ac2_watched", False):
        return func
    sig = inspect.signature(func)
    params = sig.parameters
    takes_state = "state" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
    name = getattr(func, "__name__", repr(func))

    @functools.wraps(func)
    async def wrapped(*args, **kwargs):
        state = kwargs.get("state")
        call = kwargs if takes_state else {k: v for k, v in kwargs.items() if k != "state"}
        try:
            result = func(*args, **call)
            return await result if inspect.isawaitable(result) else result
        except Exception as e:
            if state is not None:
                errors = state.get("ac2_rubric_errors") or []
                state["ac2_rubric_errors"] = [*errors, f"{name} raised {type(e).__name__}: {e}"]
            raise

    if not takes_state:
        extra = inspect.Parameter("state", inspect.Parameter.KEYWORD_ONLY, default=None)
        wrapped.__signature__ = sig.replace(parameters=[*params.values(), extra])
    wrapped._ac2_watched = True
    return wrapped


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def verifiers_env(arg: str) -> VerifiersEnv:
    """The launcher's `--env=verifiers:<id>[,key=value...]` (module docstring)."""
    import difflib
    import importlib

    vf = _vf()
    ident, *pairs = [p.strip() for p in arg.split(",")]
    if not ident:
        raise ValueError(
            "--env=verifiers:<id>[,key=value...] names no environment (e.g. "
            "verifiers:ReasoningGymEnv,gym=chain_sum)"
        )
    kwargs = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"--env=verifiers:{arg}: {pair!r} is not key=value")
        kwargs[key.strip()] = _value(value.strip())
    classes = [n for n in getattr(vf, "__all__", []) if n.endswith("Env")]
    if ":" in ident:
        module_name, _, attr = ident.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
        made = factory(**kwargs)
    elif ident in classes:
        made = getattr(vf, ident)(**kwargs)
    else:
        quiet = logging.getLogger("verifiers")  # it logs the miss too: one line is ours
        level, quiet.disabled = quiet.disabled, True
        try:
            made = vf.load_environment(ident, **kwargs)
        except (ImportError, ValueError, AttributeError) as e:
            close = difflib.get_close_matches(ident, classes, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"no verifiers environment {ident!r}{hint} (a verifiers class: "
                f"{', '.join(classes[:6])}, ...; an installed environment module; or "
                f"pkg.module:factory): {' '.join(str(e).split())}"
            ) from None
        finally:
            quiet.disabled = level
    return VerifiersEnv(made, name=ident.rpartition(":")[2])
