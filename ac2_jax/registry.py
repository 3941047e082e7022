"""Registries: the library's extension points, each a name -> implementation table.

One `Registry` per extension point (model families, RL objectives,
distillation divergences, tool-call parsers ...). Adding an implementation is
one new module with a `@REGISTRY.register("name")` decorator and its test;
nothing shared changes. A registry may name a module of built-ins that is
imported on first lookup, so the built-ins are there without import cycles.

A config section picks a registered class by its `kind` key when the
dataclass field's type is a base class with a `__registry__` attribute
(`ac2_jax.config.from_config`): e.g. `rl.loss = dict(kind="ppo", clip_eps=0.2)`.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> registered objects (classes, factories or functions) of one kind.

    Args:
      kind: what the entries are, for messages ("model family", "RL objective").
      builtins: a module imported before the first lookup that registers the
        built-in entries (None: none).
    """

    def __init__(self, kind: str, builtins: str | None = None):
        self.kind = kind
        self._builtins = builtins
        self._entries: dict[str, T] = {}

    def _load(self) -> None:
        if self._builtins is not None:
            name, self._builtins = self._builtins, None
            importlib.import_module(name)

    def register(self, name: str, *, replace: bool = False) -> Callable[[T], T]:
        """Decorator: `@REGISTRY.register("name")` over a class or function.

        Registering a taken name is an error unless `replace=True` (a test, or a
        user's own implementation that deliberately overrides a built-in).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(
                f"{self.kind} registry: a name must be a non-empty string, got {name!r}"
            )

        def add(obj: T) -> T:
            self._load()
            if name in self._entries and not replace and self._entries[name] is not obj:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered "
                    f"({self._entries[name]!r}); pick another name or pass "
                    "replace=True"
                )
            self._entries[name] = obj
            return obj

        return add

    def unregister(self, name: str) -> None:
        """Removes `name` (tests that register throwaway entries)."""
        self._load()
        self._entries.pop(name, None)

    def get(self, name: str) -> T:
        """The entry registered as `name`; an unknown name is a ValueError that lists
        the known ones (and the closest)."""
        self._load()
        if name not in self._entries:
            close = difflib.get_close_matches(str(name), list(self._entries), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"unknown {self.kind} {name!r}: registered are "
                f"{', '.join(sorted(self._entries)) or 'none'}{hint} (register "
                f"one with @<registry>.register({name!r}))"
            )
        return self._entries[name]

    def __getitem__(self, name: str) -> T:
        """`get(name)`: an unknown name is a did-you-mean ValueError."""
        return self.get(name)

    def name_of(self, obj: object) -> str:
        """The name `obj` (or its class) is registered under. An object whose class is
        registered under several names by a field (e.g. `DistillLoss(kind="jsd")` is the
        entry "distill_jsd") names its entry itself: its `registered_name`, which must
        be registered."""
        self._load()
        for name, entry in self._entries.items():
            if entry is obj or entry is type(obj):
                return name
        own = getattr(obj, "registered_name", None)
        if isinstance(own, str) and own in self._entries:
            return own
        raise ValueError(f"{obj!r} is not a registered {self.kind}")

    def names(self) -> tuple[str, ...]:
        self._load()
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self.names())})"
