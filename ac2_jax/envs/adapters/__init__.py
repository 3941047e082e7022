"""Adapters: environments written for other libraries, trained unchanged.

`ENV_ADAPTERS` maps a library's name to a factory `fn(argument) -> Env` (or a
`DomainMixer`), so the launcher's `--env=<library>:<argument>` builds one:

    --env=reasoning_gym:<generator>[,<generator>...]   (ac2_jax[reasoning-gym])

Each adapter imports its library on first use (`ac2_jax.extras.require`): a
missing one is the one-line install hint. A spec whose prefix is a registered
adapter name is the adapter's; any other "pkg.module:Factory" is an import
path (`envs.contract.load_env`).
"""

from __future__ import annotations

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


def adapter_of(spec: str) -> tuple[str, str] | None:
    """(adapter name, argument) when `spec` is "<adapter>:<argument>" of a registered
    adapter, else None (an import path)."""
    name, sep, arg = spec.partition(":")
    if sep and name in ENV_ADAPTERS:
        return name, arg
    return None
