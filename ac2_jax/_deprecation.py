"""Deprecation aliases: an old name that still resolves for one release, warning.

A package lists its renamed or moved names as `DEPRECATED = {old: "module:new"}` and
sets `__getattr__ = deprecated_getattr(__name__, DEPRECATED)`: `pkg.old` (and
`from pkg import old`) then returns `module.new` with a `DeprecationWarning` that names
the replacement. tests/test_public_api.py checks every alias of every package.

A moved module (issue 62, step 3: folders by concept) is listed in `MOVED_MODULES`; the
package it left calls `install_moved_modules(__name__)`, which puts a `MovedModule` at each
old path: `from old import x` gives the new module's `x` with a DeprecationWarning naming
the new path (tests/test_public_api.py checks each). Code that patches a moved module must
patch the new one (patching the old path is an error that says so).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types
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
    "ac2_jax.models.attention": "ac2_jax.models.kernels.attention",
    "ac2_jax.models.attention_accel": "ac2_jax.models.kernels.attention_accel",
    "ac2_jax.models.attention_tpu": "ac2_jax.models.kernels.attention_tpu",
    "ac2_jax.models.attention_mask": "ac2_jax.models.kernels.attention_mask",
    "ac2_jax.models.blocksparse": "ac2_jax.models.kernels.blocksparse",
    "ac2_jax.models.hf_io": "ac2_jax.models.io.hf_io",
    "ac2_jax.models.params_io": "ac2_jax.models.io.params_io",
    "ac2_jax.models.peft_io": "ac2_jax.models.io.peft_io",
    "ac2_jax.sampling.jax_sampler": "ac2_jax.sampling.engine.jax_sampler",
    "ac2_jax.sampling.decode_loop": "ac2_jax.sampling.engine.decode_loop",
    "ac2_jax.sampling.batching": "ac2_jax.sampling.engine.batching",
    "ac2_jax.sampling.worker": "ac2_jax.sampling.engine.worker",
    "ac2_jax.sampling.sglang": "ac2_jax.sampling.remote.sglang",
    "ac2_jax.sampling.sglang_lora": "ac2_jax.sampling.remote._sglang_lora",
    "ac2_jax.sampling.fleet": "ac2_jax.sampling.remote.fleet",
    "ac2_jax.serving.chat": "ac2_jax.serving.core.chat",
    "ac2_jax.serving.errors": "ac2_jax.serving.core.errors",
    "ac2_jax.serving.generation": "ac2_jax.serving.core.generation",
    "ac2_jax.serving.requests": "ac2_jax.serving.core.requests",
    "ac2_jax.serving.schemas": "ac2_jax.serving.core.schemas",
    "ac2_jax.serving.sample_run": "ac2_jax.serving.core.sample_run",
    "ac2_jax.serving.splice": "ac2_jax.serving.core.splice",
    "ac2_jax.serving.stream_generation": "ac2_jax.serving.core.stream_generation",
    "ac2_jax.serving.streaming": "ac2_jax.serving.core.streaming",
    "ac2_jax.serving.structured": "ac2_jax.serving.core.structured",
    "ac2_jax.serving.api_builtins": "ac2_jax.serving.apis._builtins",
    "ac2_jax.serving.messages": "ac2_jax.serving.apis.messages.routes",
    "ac2_jax.serving.messages_blocks": "ac2_jax.serving.apis.messages._blocks",
    "ac2_jax.serving.messages_output": "ac2_jax.serving.apis.messages._output",
    "ac2_jax.serving.messages_schemas": "ac2_jax.serving.apis.messages.schemas",
    "ac2_jax.serving.responses": "ac2_jax.serving.apis.responses.routes",
    "ac2_jax.serving.responses_output": "ac2_jax.serving.apis.responses._output",
    "ac2_jax.serving.responses_schemas": "ac2_jax.serving.apis.responses.schemas",
    "ac2_jax.serving.gemini": "ac2_jax.serving.apis.gemini.routes",
    "ac2_jax.serving.gemini_schemas": "ac2_jax.serving.apis.gemini.schemas",
    "ac2_jax.serving.rollouts": "ac2_jax.serving.lifecycle.rollouts",
    "ac2_jax.serving.rollout_requests": "ac2_jax.serving.lifecycle.rollout_requests",
}


class MovedModule(types.ModuleType):
    """The module object left at a moved module's old path: each attribute read warns
    (naming the new path) and returns the new module's object. Setting or deleting an
    attribute here (a test's `monkeypatch.setattr(old_module, ...)`) would change nothing
    the library reads, so it is an AttributeError naming the module to patch."""

    def __init__(self, old: str, new: str):
        super().__init__(old, f"Deprecated: moved to {new} (this alias goes in the next release).")
        self.__dict__["__spec__"] = importlib.machinery.ModuleSpec(old, None)
        self.__dict__["_new"] = new

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        warnings.warn(
            f"{self.__name__} is deprecated and goes in the next release: use {self._new}",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(self._new), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if not name.startswith("__"):
            raise AttributeError(
                f"{self.__name__} is a deprecation alias of {self._new}: set {name} on "
                f"{self._new} (setting it here would change nothing the library reads)"
            )
        self.__dict__[name] = value

    def __delattr__(self, name: str) -> None:
        if not name.startswith("__"):
            raise AttributeError(
                f"{self.__name__} is a deprecation alias of {self._new}: delete {name} "
                f"from {self._new}"
            )
        del self.__dict__[name]

    def __dir__(self) -> list[str]:
        return dir(importlib.import_module(self._new))


def install_moved_modules(package: str) -> None:
    """Puts a `MovedModule` at each old path of `MOVED_MODULES` directly under `package`
    (its `__init__` calls this last): `import old`, `from old import x` and
    `package.old.x` keep working, warning. No file is left at the old path, so a package
    attribute of that name (`ac2_jax.models.attention`, the function) stays itself."""
    parent = sys.modules[package]
    for old, new in MOVED_MODULES.items():
        head, _, child = old.rpartition(".")
        if head != package or old in sys.modules:
            continue
        sys.modules[old] = module = MovedModule(old, new)
        if child not in vars(parent):
            setattr(parent, child, module)
