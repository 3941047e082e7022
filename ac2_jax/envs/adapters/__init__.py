"""Adapters: environments written for other libraries, trained unchanged.

`ENV_ADAPTERS` maps a library's name to a factory `fn(argument) -> Env` (or a
`DomainMixer`), so the launcher's `--env=<library>:<argument>` builds one:

    --env=reasoning_gym:<generator>[,<generator>...]   (ac2_jax[reasoning-gym])
    --env=verifiers:<env id or class>[,key=value...]   (ac2_jax[verifiers])
    --env=textarena:<game id>                          (ac2_jax[textarena])
    --env=gym:<env id>[,key=value...]                  (ac2_jax[gymnasium])
    --env=openenv:<url or module>[,key=value...]       (ac2_jax[openenv])
    --env=mix:<spec>+<spec>+...                        (a DomainMixer of them:
                                                        envs.contract.mixed_env)

Each adapter imports its library on first use (`ac2_jax.extras.require`): a
missing one is the one-line install hint. A spec whose prefix is a registered
adapter name is the adapter's; any other "pkg.module:Factory" is an import
path (`envs.contract.load_env`).

An adapter whose harness is the library's own loop (verifiers) or records the
whole attempt for its verifier (textarena) is an orchestrator, a layer above
envs: it lives in `ac2_jax.orchestration` and is registered here by module
name, imported when its spec is first loaded.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ac2_jax.envs.adapters.reasoning_gym import (
    MIX_PRESETS,
    ReasoningGymEnv,
    reasoning_gym_env,
    verifier_audit,
)
from ac2_jax.registry import Registry

__all__ = [
    "ENV_ADAPTERS",
    "MIX_PRESETS",
    "ReasoningGymEnv",
    "adapter_of",
    "reasoning_gym_env",
    "verifier_audit",
]

ENV_ADAPTERS: Registry[Callable[[str], Any]] = Registry("env adapter")
ENV_ADAPTERS.register("reasoning_gym")(reasoning_gym_env)


def _by_name(module: str, factory: str) -> Callable[[str], Any]:
    """A factory that imports `module` (a higher layer) when first called."""

    def make(arg: str) -> Any:
        return getattr(importlib.import_module(module), factory)(arg)

    make.__name__ = factory
    make.__doc__ = f"{module}.{factory}"
    return make


ENV_ADAPTERS.register("verifiers")(_by_name("ac2_jax.orchestration.verifiers_env", "verifiers_env"))
ENV_ADAPTERS.register("gym")(_by_name("ac2_jax.orchestration.gym_env", "gym_env"))
ENV_ADAPTERS.register("textarena")(_by_name("ac2_jax.orchestration.textarena_env", "textarena_env"))
ENV_ADAPTERS.register("openenv")(_by_name("ac2_jax.orchestration.openenv_env", "openenv_env"))


def adapter_of(spec: str) -> tuple[str, str] | None:
    """(adapter name, argument) when `spec` is "<adapter>:<argument>" of a registered
    adapter, else None (an import path)."""
    name, sep, arg = spec.partition(":")
    if sep and name in ENV_ADAPTERS:
        return name, arg
    return None
