"""Deprecation aliases: an old name that still resolves for one release, warning.

A package lists its renamed or moved names as `DEPRECATED = {old: "module:new"}` and
sets `__getattr__ = deprecated_getattr(__name__, DEPRECATED)`: `pkg.old` (and
`from pkg import old`) then returns `module.new` with a `DeprecationWarning` that names
the replacement. tests/test_public_api.py checks every alias of every package.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def deprecated_getattr(module: str, aliases: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` resolving each old name of `aliases` ("module:new") to its
    new home with a DeprecationWarning; any other name raises AttributeError as usual."""

    def __getattr__(name: str) -> Any:
        target = aliases.get(name)
        if target is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home, _, new = target.partition(":")
        warnings.warn(
            f"{module}.{name} is deprecated and goes in the next release: use {home}.{new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(home), new)

    return __getattr__
