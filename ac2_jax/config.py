"""One config schema: ml_collections / dict configs -> the typed dataclasses.

A config section has exactly the key names of the dataclass it becomes:

    rl = from_config(RLConfig, cfg.rl)           # cfg.rl.batch.rows -> rl.batch.rows
    model = from_config(DecoderConfig, cfg.model, vocab_size=tok.vocab_size)

A field typed with a registry base (a class with `__registry__`, e.g.
`training.Objective`) is built from the class its section names with `kind`
(`ac2_jax.registry`): `rl.loss = dict(kind="ppo", clip_eps=0.2)`; without
`kind`, the base's `__default_kind__`. Nested dataclass fields recurse,
lists become tuples where the field is a tuple, and every value is
type-checked. An unknown key (with a "did you
mean"), a missing required key, a wrong type, or a value the dataclass
rejects raises `ConfigError` naming the key path (e.g. `rl.batch.rows`).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any

__all__ = ["ConfigError", "from_config", "select_variant"]


class ConfigError(ValueError):
    """A config does not fit its dataclass; the message names the key path."""


def _as_mapping(cfg: Any, path: str) -> Mapping:
    if isinstance(cfg, Mapping):
        return cfg
    if hasattr(cfg, "to_dict"):  # ml_collections.ConfigDict (references resolved)
        return cfg.to_dict()
    raise ConfigError(
        f"{path or '<config>'}: expected a mapping (dict or ConfigDict) of "
        f"fields, got {type(cfg).__name__} {cfg!r}"
    )


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def from_config(cls: type, cfg: Any, *, path: str = "", **overrides: Any) -> Any:
    """Builds dataclass `cls` from `cfg` (ConfigDict or Mapping), same key names.

    Args:
      cls: a dataclass type; fields that are dataclasses are built recursively.
      cfg: the section, e.g. `config.rl`.
      path: the section's key path, used in error messages (e.g. "rl").
      **overrides: fields the caller sets (e.g. vocab_size from the tokenizer);
        the config must not set them too.

    Returns:
      `cls(**fields)`.

    Raises:
      ConfigError: naming the key path on an unknown, missing, doubly set or
        ill-typed key, or when `cls` itself rejects a value.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"from_config: cls must be a dataclass type, got {cls!r}")
    data = dict(_as_mapping(cfg, path))
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = typing.get_type_hints(cls)
    for key in data:
        if not isinstance(key, str) or key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {_join(path, close[0])!r}?" if close else ""
            known = f"fields: {', '.join(fields)}" if fields else "it takes no fields"
            raise ConfigError(
                f"{_join(path, str(key))}: unknown key for {cls.__name__} ({known}){hint}"
            )
    for key in overrides:
        if key not in fields:
            raise TypeError(f"from_config: override {key!r} is not a field of {cls.__name__}")
        if key in data:
            raise ConfigError(
                f"{_join(path, key)}: set by the caller ({key}="
                f"{overrides[key]!r}); remove it from the config"
            )
    kwargs = {}
    for name, f in fields.items():
        if name in overrides:
            kwargs[name] = overrides[name]
        elif name in data:
            kwargs[name] = _convert(hints[name], data[name], _join(path, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{_join(path, name)}: missing required key for {cls.__name__}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{path or cls.__name__}: {e}") from e


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(tp: Any, value: Any, path: str) -> Any:
    """`value` checked against type `tp` (lists -> tuples, int -> float, dicts -> dataclasses)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{path}: None is not allowed (expected {_type_name(tp)})")
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own error names the problem
            return _convert(options[0], value, path)
        for arg in options:
            try:
                return _convert(arg, value, path)
            except ConfigError:
                pass
        raise ConfigError(
            f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}"
        )
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ConfigError(f"{path}: expected one of {typing.get_args(tp)}, got {value!r}")
    registry = getattr(tp, "__registry__", None) if isinstance(tp, type) else None
    if registry is not None:
        if isinstance(value, tp):
            return value
        data = dict(_as_mapping(value, path))
        kind = data.pop("kind", None) or getattr(tp, "__default_kind__", None)
        try:
            chosen = registry.get(kind)
        except ValueError as e:
            raise ConfigError(f"{_join(path, 'kind')}: {e}") from e
        if not (isinstance(chosen, type) and issubclass(chosen, tp)):
            raise ConfigError(
                f"{_join(path, 'kind')}: {kind!r} is registered as {chosen!r}, not a {tp.__name__}"
            )
        return from_config(chosen, data, path=path)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        return from_config(tp, value, path=path)
    if origin is tuple or tp is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(
                f"{path}: expected a tuple (or list), got {type(value).__name__} {value!r}"
            )
        args = typing.get_args(tp)
        if not args:
            return tuple(value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(
                f"{path}: expected {len(args)} items ({_type_name(tp)}), "
                f"got {len(value)}: {value!r}"
            )
        return tuple(
            _convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    if origin is list or tp is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        (arg,) = typing.get_args(tp) or (Any,)
        return [_convert(arg, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        return dict(_as_mapping(value, path))
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is type(None):
        if value is None:
            return None
    elif isinstance(tp, type):
        if isinstance(value, tp):
            return value
    else:
        return value  # a type we cannot check (a Protocol, a TypeVar): passed through
    raise ConfigError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")


def select_variant(variant: str | None, variants: Mapping[str, Any]) -> Any:
    """The entry of `variants` named by a config file's `:variant` (None or "": "default").

    Raises ConfigError naming the known variants on an unknown one.
    """
    name = variant or "default"
    if name not in variants:
        raise ConfigError(
            f"unknown config variant {name!r}; known variants: {', '.join(sorted(variants))}"
        )
    return variants[name]
