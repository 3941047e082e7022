"""Deprecation aliases: an old name that still resolves for one release, warning.

A package lists its renamed or moved names as `DEPRECATED = {old: "module:new"}` and
sets `__getattr__ = deprecated_getattr(__name__, DEPRECATED)`: `pkg.old` (and
`from pkg import old`) then returns `module.new` with a `DeprecationWarning` that names
the replacement. tests/test_public_api.py checks every alias of every package.

A moved module leaves a file at its old path that calls `moved_module(__name__)`: the old
import path then gives the new module itself (same objects, `monkeypatch` strings work),
with a DeprecationWarning naming the new path. `MOVED_MODULES` lists them all (issue 62,
step 3: folders by concept); tests/test_public_api.py checks each.
"""

from __future__ import annotations

import importlib
import sys
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


# Old module path -> new module path, for one release.
MOVED_MODULES = {
    "ac2_jax.models.tokenizer": "ac2_jax.text.tokenizer",
    "ac2_jax.models.tiny_tokenizer": "ac2_jax.text.tiny_tokenizer",
    "ac2_jax.models.chat_template": "ac2_jax.text.chat_template",
    "ac2_jax.models.tool_parsers": "ac2_jax.text.tool_parsers",
}


def moved_module(old: str) -> None:
    """Called by the alias file left at `old` (`MOVED_MODULES`): warns that the module
    moved and makes `old` the new module (`sys.modules[old]`), so `import old` and
    `from old import x` give the new module's objects."""
    new = MOVED_MODULES[old]
    warnings.warn(
        f"{old} is deprecated and goes in the next release: use {new}",
        DeprecationWarning,
        stacklevel=3,
    )
    sys.modules[old] = importlib.import_module(new)
