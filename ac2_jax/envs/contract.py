"""The environment contract, checked at start-up: what a recipe needs of an env.

An environment is an `Env` (envs/base.py) with:

- tasks:     `sample_tasks(n, seed, split)` -> `Task`s, deterministic, unique
             ids, train and eval splits apart;
- a harness: `make_harness(task, client, model_name, *, sampling, max_steps)`
             returning an orchestrator (optional: the default is the tool loop,
             `DefaultOrchestrator`); `sampling` is the request sampling dict.
             An external program that talks to the endpoint is a harness too:
             its orchestrator runs the program with the rollout's base URL;
- a verifier: `verify(task, answer)` -> a float in `reward_range`;
- tools:     the `tools` the harness offers (optional);
- for SFT:   `demonstration(task)` -> an OpenAI-format chat that solves it;
- for distillation: `hint(task)` -> the hint text (None: no hint for it);
- multi-turn (optional): `reply(task, messages)` -> the env's next user message
             after each answer of the agent, or None to end the attempt
             (`orchestration.EnvUser`). A pure function of the task and the
             conversation so far, so that a recorded attempt replays.

`load_env("pkg.module:Factory")` builds one from an import path (a class or
a function, called with no arguments), or from another library's environment
through its adapter ("reasoning_gym:chain_sum", `envs.adapters.ENV_ADAPTERS`);
`check_env(env, recipe)` raises one `EnvError` listing every missing or broken
piece. A `DomainMixer` is checked domain by domain, and its own task stream too.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
from collections.abc import Callable
from typing import Any

from ac2_jax.envs.adapters import ENV_ADAPTERS, adapter_of
from ac2_jax.envs.base import Env, Task, Tool
from ac2_jax.envs.mixer import DomainMixer

__all__ = ["EnvError", "check_env", "load_env", "mixed_env", "needs_of"]

# What each recipe needs beyond tasks and a verifier.
_NEEDS = {"rl": (), "sft": ("demonstration",), "distill": ("hint",)}


class EnvError(ValueError):
    """An environment that does not meet the contract; the message lists every problem."""


def needs_of(recipe: str) -> tuple[str, ...]:
    """The optional methods `recipe` requires ("rl", "sft", "distill")."""
    if recipe not in _NEEDS:
        raise ValueError(f"unknown recipe {recipe!r}; known: {', '.join(_NEEDS)}")
    return _NEEDS[recipe]


def _adapted(spec: str) -> Env | None:
    """The env of an adapter spec "<library>:<argument>" (None: not one)."""
    found = adapter_of(spec)
    if found is None:
        name = spec.partition(":")[0]
        close = difflib.get_close_matches(name, ENV_ADAPTERS.names(), n=1, cutoff=0.75)
        if close and importlib.util.find_spec(name.split(".")[0]) is None:
            raise EnvError(
                f"--env {spec!r}: no adapter {name!r} nor module of that name; did you mean "
                f"{close[0]}:? (adapters: {', '.join(ENV_ADAPTERS.names())})"
            )
        return None
    name, arg = found
    try:
        return ENV_ADAPTERS.get(name)(arg)
    except ImportError:
        raise  # the missing extra's one-line hint
    except Exception as e:  # noqa: BLE001 - the adapter's own refusal, with the spec
        raise EnvError(f"--env {spec!r}: {' '.join(str(e).split())}") from e


def load_env(spec: str | Env | Callable[[], Env]) -> Env:
    """An Env (a DomainMixer included) from an instance, a factory, an adapter spec
    "<library>:<argument>" or an import path "pkg.module:Factory"."""
    if isinstance(spec, Env):
        return spec
    if isinstance(spec, str):
        adapted = _adapted(spec)
        if adapted is not None:
            return adapted
    if callable(spec):
        obj: Any = spec
        where = getattr(spec, "__qualname__", repr(spec))
    else:
        module_name, sep, attr = str(spec).partition(":")
        if not sep or not module_name or not attr:
            raise EnvError(f"--env {spec!r}: expected an import path 'pkg.module:Factory'")
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise EnvError(
                f"--env {spec!r}: cannot import {module_name!r} ({e}); run from the "
                "folder that holds the package or put it on PYTHONPATH"
            ) from None
        obj = module
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise EnvError(f"--env {spec!r}: {module_name} has no attribute {part!r}")
            obj = getattr(obj, part)
        where = spec
    env = obj
    if (inspect.isclass(obj) or callable(obj)) and not isinstance(obj, Env):
        try:
            env = obj()
        except Exception as e:  # noqa: BLE001 - reported with the spec that failed
            raise EnvError(
                f"--env {where}: calling it with no arguments raised {type(e).__name__}: {e}"
            ) from e
    if not isinstance(env, Env):
        raise EnvError(
            f"--env {where}: built a {type(env).__name__}, not an ac2_jax.envs.Env "
            "(subclass Env: sample_tasks and verify)"
        )
    return env


def mixed_env(arg: str) -> DomainMixer:
    """The launcher's `--env=mix:<spec>+<spec>+...`: one DomainMixer of the envs the
    adapter specs (or import paths) build, a domain per env (a spec that is itself a
    mix adds its domains), named by the env's `name`; equal fixed weights
    (`--config.mix.adaptive=true` adapts them)."""
    specs = [p.strip() for p in arg.split("+") if p.strip()]
    if len(specs) < 2:
        raise ValueError(
            "--env=mix:<spec>+<spec>+... needs two or more env specs "
            "(e.g. mix:reasoning_gym:gcd+textarena:GuessTheNumber-v0)"
        )
    envs: dict[str, Env] = {}
    for spec in specs:
        env = load_env(spec)
        parts = env.envs if isinstance(env, DomainMixer) else {env.name: env}
        for name, e in parts.items():
            if name in envs:
                raise ValueError(f"--env=mix:{arg}: domain {name!r} comes twice")
            envs[name] = e
    return DomainMixer(envs)


ENV_ADAPTERS.register("mix")(mixed_env)


def _probe_tasks(env: Env, problems: list[str]) -> list[Task]:
    tasks: dict[str, list[Task]] = {}
    for split in ("train", "eval"):
        try:
            got = env.sample_tasks(4, seed=0, split=split)
            again = env.sample_tasks(4, seed=0, split=split)
        except Exception as e:  # noqa: BLE001 - reported as a contract problem
            problems.append(f"sample_tasks(4, seed=0, split={split!r}) raised {e!r}")
            continue
        if not isinstance(got, list) or not all(isinstance(t, Task) for t in got):
            problems.append(f"sample_tasks must return a list of Task, got {type(got).__name__}")
            continue
        if len(got) != 4:
            problems.append(f"sample_tasks(4, ...) returned {len(got)} tasks")
        ids = [t.task_id for t in got]
        if len(set(ids)) != len(ids):
            problems.append(f"sample_tasks({split!r}) repeats task ids: {ids}")
        if ids != [t.task_id for t in again]:
            problems.append(f"sample_tasks({split!r}) is not deterministic in its seed")
        tasks[split] = got
    if "train" in tasks and "eval" in tasks:
        shared = {t.task_id for t in tasks["train"]} & {t.task_id for t in tasks["eval"]}
        if shared:
            problems.append(f"train and eval splits share task ids {sorted(shared)}")
    return tasks.get("train", [])


def _check_mixer(mixer: DomainMixer, recipe: str) -> DomainMixer:
    """Each domain's env against the contract, then the mixer's own task stream
    (deterministic, unique ids, disjoint splits); one EnvError naming every problem."""
    problems: list[str] = []
    for domain, env in mixer.envs.items():
        try:
            check_env(env, recipe)
        except EnvError as e:
            problems.append(f"domain {domain!r}: {e}")
    _probe_tasks(mixer, problems)
    if problems:
        raise EnvError(f"DomainMixer does not meet the env contract: {'; '.join(problems)}")
    return mixer


def demonstration_problems(env: Env, task: Task, messages: list[dict[str, Any]]) -> list[str]:
    """What is wrong with `messages`, a demonstration of `task` ending in an assistant
    turn: its final answer (that turn's content) must earn the verifier's top reward,
    and each tool call must name one of the env's tools (when it has tools) with
    arguments that are a JSON object. [] when nothing is; the SFT recipe checks every
    demonstration so, `check_env` the probed ones."""
    import json

    problems, where = [], f"demonstration({task.task_id!r})"
    names = []
    try:
        names = [t.name for t in env.tools]
    except Exception:  # noqa: BLE001 - check_env reports a broken `tools` itself
        pass
    n = 0
    for m in messages:
        for call in (m.get("tool_calls") or []) if m.get("role") == "assistant" else []:
            n += 1
            fn = call.get("function") if isinstance(call, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str):
                problems.append(f"{where}: tool call {n} has no function name")
                continue
            if names and name not in names:
                problems.append(
                    f"{where}: tool call {n} calls {name!r}, not a tool of the env "
                    f"({', '.join(names)})"
                )
            args: Any = fn.get("arguments", "{}") if isinstance(fn, dict) else None
            try:
                ok = isinstance(args, dict) or (
                    isinstance(args, str) and isinstance(json.loads(args), dict)
                )
            except ValueError:
                ok = False
            if not ok:
                problems.append(
                    f"{where}: tool call {n} ({name}) has arguments that are not a JSON "
                    f"object: {args!r:.60}"
                )
    answer = messages[-1].get("content")
    answer = answer if isinstance(answer, str) else None
    _, high = env.reward_range
    try:
        reward = env.verify(task, answer)
    except Exception as e:  # noqa: BLE001 - reported as a contract problem
        return [*problems, f"verify({task.task_id!r}, <its demonstration's answer>) raised {e!r}"]
    if isinstance(reward, (int, float)) and reward < high:
        problems.append(
            f"{where} answers {answer!r:.60}, which its verifier rewards {reward}, not the "
            f"top reward {high} (a demonstration must solve its task)"
        )
    return problems


def check_env(env: Env, recipe: str = "rl") -> Env:
    """Checks `env` against the contract for `recipe`; returns it.

    Raises EnvError naming every problem: tasks (deterministic, unique ids,
    disjoint splits), the verifier (a float in reward_range for no answer and
    for the reference answer, which must earn the top reward), tools (Tool
    objects, distinct names), a callable `make_harness` and `reply` if given, and
    the recipe's own needs (`demonstration` for sft, `hint` for distill); a probed
    demonstration must pass `demonstration_problems` (its answer earns the top
    reward, its tool calls name the env's tools with JSON-object arguments).
    """
    if isinstance(env, DomainMixer):
        return _check_mixer(env, recipe)
    problems: list[str] = []
    name = type(env).__name__
    tasks = _probe_tasks(env, problems)
    low, high = env.reward_range
    try:
        tools = list(env.tools)
        if not all(isinstance(t, Tool) for t in tools):
            problems.append("tools must be ac2_jax.envs.Tool objects")
        elif len({t.name for t in tools}) != len(tools):
            problems.append(f"tool names repeat: {[t.name for t in tools]}")
    except Exception as e:  # noqa: BLE001
        problems.append(f"tools raised {e!r}")
    harness = getattr(env, "make_harness", None)
    if harness is not None and not callable(harness):
        problems.append(
            "make_harness must be callable: (task, client, model_name, *, sampling, "
            "max_steps) -> orchestrator"
        )
    reply = getattr(env, "reply", None)
    if reply is not None and not callable(reply):
        problems.append("reply must be callable: (task, messages) -> str | None")
    elif reply is not None:
        for task in tasks[:1]:
            try:
                got = reply(
                    task,
                    env.initial_messages(task)
                    + [{"role": "assistant", "content": env.reference_answer(task) or ""}],
                )
            except Exception as e:  # noqa: BLE001
                problems.append(f"reply({task.task_id!r}, ...) raised {e!r}")
                continue
            if got is not None and not isinstance(got, str):
                problems.append(f"reply({task.task_id!r}, ...) must give a str or None")
    for task in tasks[:2]:
        ref = env.reference_answer(task)
        for answer in (None,) if ref is None else (None, ref):
            try:
                reward = env.verify(task, answer)
            except Exception as e:  # noqa: BLE001
                problems.append(f"verify({task.task_id!r}, {answer!r:.40}) raised {e!r}")
                continue
            if not isinstance(reward, (int, float)) or not low <= reward <= high:
                problems.append(
                    f"verify({task.task_id!r}, ...) gave {reward!r}, outside reward_range "
                    f"{env.reward_range}"
                )
            elif answer is not None and reward < high:
                problems.append(
                    f"reference_answer({task.task_id!r}) earns {reward}, not the top reward {high}"
                )
    for method in needs_of(recipe):
        fn = getattr(env, method, None)
        if not callable(fn):
            what = "an OpenAI-format chat solving it" if method == "demonstration" else "a str"
            problems.append(f"recipe {recipe!r} needs {name}.{method}(task) -> {what}")
            continue
        for task in tasks[:1]:
            try:
                got = fn(task)
            except Exception as e:  # noqa: BLE001
                problems.append(f"{method}({task.task_id!r}) raised {e!r}")
                continue
            if method == "demonstration" and not (
                isinstance(got, list) and got and got[-1].get("role") == "assistant"
            ):
                problems.append(f"demonstration({task.task_id!r}) must end with an assistant turn")
            elif method == "demonstration":
                problems += demonstration_problems(env, task, got)
            if method == "hint" and got is not None and not isinstance(got, str):
                problems.append(f"hint({task.task_id!r}) must be a str or None")
    if problems:
        raise EnvError(f"{name} does not meet the env contract: " + "; ".join(problems))
    return env
