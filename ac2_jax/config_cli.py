"""A typed config from a file and command-line overrides, each mistake one line.

    cfg = load_config(RLRecipeConfig, "my_config.py:quick",
                      ["rl.optimizer.learning_rate=5e-4", "rl.dynamic_sampling=true"])

The schema is the dataclass: its defaults are the base (`to_dict`), so every
field can be set whether or not the file lists it. The file (optional)
defines `get_config(variant=None)` returning a mapping (dict or ConfigDict)
of the fields it sets, any subset; each override `dotted.path=value` then
sets one field, its text parsed by the field's type (`parse_value`). The
result goes through `from_config`, which checks every value. A path that
names no field is a `ConfigError` of one line naming it, the type of the
section, and the nearest valid paths (`nearest_paths`: close spellings and
abbreviations, so `rl.lr` finds `rl.optimizer.learning_rate`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from ac2_jax.config import ConfigError, from_config

__all__ = ["load_config", "nearest_paths", "parse_value", "schema_paths", "to_dict"]


def _registry(tp: Any):
    return getattr(tp, "__registry__", None) if isinstance(tp, type) else None


def to_dict(obj: Any) -> Any:
    """A dataclass instance as nested plain data (the form `from_config` reads back);
    a field typed with a registry base also gets its `kind`."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        if isinstance(obj, tuple):
            return [to_dict(v) for v in obj]
        return obj
    hints = typing.get_type_hints(type(obj))
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        value = getattr(obj, f.name)
        out[f.name] = to_dict(value)
        registry = _registry(hints[f.name])
        if registry is not None and dataclasses.is_dataclass(value):
            out[f.name] = {"kind": registry.name_of(value), **out[f.name]}
    return out


def _options(tp: Any) -> list[Any]:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(tp) if a is not type(None)]
    return [tp]


def _section_class(tp: Any, kind: str | None = None) -> type | None:
    """The dataclass a field of type `tp` is built from (None: a leaf)."""
    for opt in _options(tp):
        registry = _registry(opt)
        if registry is not None:
            return registry.get(kind or opt.__default_kind__)
        if isinstance(opt, type) and dataclasses.is_dataclass(opt):
            return opt
    return None


def schema_paths(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every settable dotted path of dataclass `cls` -> its type (leaves and sections)."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path = f"{prefix}{f.name}"
        out[path] = hints[f.name]
        sub = _section_class(hints[f.name])
        if sub is not None:
            if _registry(_options(hints[f.name])[0]) is not None:
                out[f"{path}.kind"] = str
            out.update(schema_paths(sub, path + "."))
    return out


def _initials(name: str) -> str:
    return "".join(w[0] for w in name.split("_") if w)


def nearest_paths(path: str, paths: Sequence[str], n: int = 3) -> list[str]:
    """The valid `paths` nearest to a mistyped `path`: same section first, then by
    the spelling of the whole path and of its last name, and abbreviations
    (`lr` for `learning_rate`)."""
    head, _, leaf = path.rpartition(".")

    def score(p: str) -> float:
        p_head, _, p_leaf = p.rpartition(".")
        s = max(
            difflib.SequenceMatcher(None, path, p).ratio(),
            difflib.SequenceMatcher(None, leaf, p_leaf).ratio() - 0.05,
        )
        if leaf and leaf in (_initials(p_leaf), p_leaf[: len(leaf)]) and len(leaf) > 1:
            s = max(s, 0.9)
        if p_head == head or p_head.startswith(head + ".") if head else True:
            s += 0.1
        return s

    ranked = sorted(paths, key=lambda p: (-score(p), p))
    return [p for p in ranked[:n] if score(p) >= 0.5]


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise ValueError("expected true or false")


def parse_value(tp: Any, text: str) -> Any:
    """The value of a command-line `text` for a field of type `tp`: "none"/"null" for
    an Optional; bool as true/false/1/0; numbers; a tuple or list as a Python literal
    or comma-separated items; strings as written. ValueError when it cannot fit."""
    options = _options(tp)
    optional = len(options) < len(typing.get_args(tp)) if typing.get_args(tp) else False
    if optional and text.strip().lower() in ("none", "null"):
        return None
    errors = []
    for opt in options:
        origin = typing.get_origin(opt) or opt
        try:
            if opt is bool:
                return _bool(text)
            if opt is int:
                return int(text)
            if opt is float:
                return float(text)
            if opt is str or opt is Any:
                return text
            if origin is typing.Literal:
                choices = typing.get_args(opt)
                if text in choices:
                    return text
                raise ValueError(f"expected one of {choices}")
            if origin in (tuple, list):
                try:
                    value = ast.literal_eval(text)
                except (ValueError, SyntaxError):
                    value = [v.strip() for v in text.split(",") if v.strip()]
                args = [a for a in typing.get_args(opt) if a is not Ellipsis] or [Any]
                items = value if isinstance(value, (list, tuple)) else [value]
                return [
                    parse_value(args[min(i, len(args) - 1)], v) if isinstance(v, str) else v
                    for i, v in enumerate(items)
                ]
            value = ast.literal_eval(text)
            return value
        except (ValueError, SyntaxError) as e:
            errors.append(str(e))
    raise ValueError(f"expected {_type_text(tp)}" + (f" ({errors[-1]})" if errors else ""))


def _type_text(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _load_file(spec: str) -> Mapping:
    path, _, variant = spec.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"--config: no config file {path!r} (expected FILE.py[:variant])")
    mod_spec = importlib.util.spec_from_file_location("_ac2_user_config", path)
    assert mod_spec is not None and mod_spec.loader is not None
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    get = getattr(module, "get_config", None)
    if get is None:
        raise ConfigError(f"--config: {path} defines no get_config(variant=None)")
    cfg = get(variant or None) if variant else get()
    if hasattr(cfg, "to_dict"):
        cfg = cfg.to_dict()
    if not isinstance(cfg, Mapping):
        raise ConfigError(
            f"--config: {path}'s get_config returned {type(cfg).__name__}, not a dict"
        )
    return cfg


def _merge(base: dict, over: Mapping, cls: type, path: str, paths: dict[str, Any]) -> dict:
    out = dict(base)
    for key, value in over.items():
        full = f"{path}{key}"
        if full not in paths:
            _unknown(full, cls, paths)
        sub = _section_class(paths[full], value.get("kind") if isinstance(value, Mapping) else None)
        if sub is not None and isinstance(value, Mapping):
            prev = out.get(key)
            old: dict = dict(prev) if isinstance(prev, Mapping) else {}
            if "kind" in value and old.get("kind") != value["kind"]:
                old = {"kind": value["kind"]}  # another class: its own defaults
            out[key] = _merge(old, value, cls, full + ".", paths)
        else:
            out[key] = value
    return out


def _unknown(full: str, cls: type, paths: dict[str, Any]) -> typing.NoReturn:
    head = full.rpartition(".")[0]
    section = cls.__name__ if not head else _type_text(paths.get(head, cls))
    near = nearest_paths(full, list(paths))
    hint = "; nearest: " + ", ".join(f"{p} ({_type_text(paths[p])})" for p in near) if near else ""
    raise ConfigError(f"{full}: no such field in {section}{hint}")


def _nested(path: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(path.split(".")):
        out = {part: out}
    return out


def load_config(cls: type, file: str | None = None, overrides: Sequence[str] = ()) -> Any:
    """`cls` from its defaults, then `file` ("FILE.py[:variant]"), then each
    `dotted.path=value` of `overrides`, checked by `from_config`.

    Raises ConfigError (one line) naming the field on a bad path or value."""
    paths = schema_paths(cls)
    data = to_dict(cls())
    if file:
        data = _merge(data, _load_file(file), cls, "", paths)
    for item in overrides:
        key, eq, text = item.partition("=")
        key = key.strip().removeprefix("--").removeprefix("config.")
        if not eq or not key:
            raise ConfigError(f"override {item!r}: expected --config.FIELD=VALUE")
        if key not in paths:
            _unknown(key, cls, paths)
        try:
            value = parse_value(paths[key], text)
        except ValueError as e:
            raise ConfigError(f"{key}={text!r}: {e}") from None
        data = _merge(data, _nested(key, value), cls, "", paths)
    return from_config(cls, data)
