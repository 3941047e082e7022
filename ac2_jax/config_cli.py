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
import re
import textwrap
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
            # The entry's name is the section's `kind` (an own `kind` field, as
            # DistillLoss's, is in that name: `Registry.name_of`).
            fields = {k: v for k, v in out[f.name].items() if k != "kind"}
            out[f.name] = {"kind": registry.name_of(value), **fields}
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
            base = _options(hints[f.name])[0]
            registry = _registry(base)
            if registry is not None:
                out[f"{path}.kind"] = str
            out.update(schema_paths(sub, path + "."))
            if registry is not None:  # the other kinds' own fields (from_config checks
                for name in registry.names():  # them against the kind chosen)
                    kind_cls = registry.get(name)
                    if isinstance(kind_cls, type) and issubclass(kind_cls, base):
                        for k, v in schema_paths(kind_cls, path + ".").items():
                            out.setdefault(k, v)
    return out


def _comments(cls: type) -> dict[str, str]:
    """{field: its comment} from `cls`'s source: the comment on the field's line, else
    the comment lines right above it; fields with neither are left out."""
    import inspect
    import io
    import tokenize

    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and lines[tok.start[0] - 1][: tok.start[1]].strip():
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    out: dict[str, str] = {}
    body = ast.parse(source).body[0]
    for node in getattr(body, "body", []):
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        text = trailing.get(node.lineno) or trailing.get(node.end_lineno or node.lineno)
        if not text:
            above: list[str] = []
            i = node.lineno - 2
            while i >= 0 and lines[i].strip().startswith("#"):
                above.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            text = " ".join(above)
        if text:
            out[node.target.id] = text
    return out


def _doc(cls: type) -> str:
    """`cls`'s own docstring on one line ("" for a dataclass's generated signature)."""
    doc = cls.__dict__.get("__doc__") or ""
    if doc.startswith(f"{cls.__name__}("):
        return ""
    return " ".join(doc.split())


def _from_docstring(cls: type, name: str) -> str:
    """The sentence of `cls`'s docstring (or its bases') that names `name` (as `name`,
    name:, name ( or name=); "" if none does."""
    docs = [_doc(c) for c in cls.__mro__ if dataclasses.is_dataclass(c)]
    sentences = [s for doc in docs for s in re.split(r"(?<=[.;])\s+", doc) if s]
    pattern = rf"`{name}`|\b{name}:|\b{name} \(|\b{name}="
    return next((s for s in sentences if re.search(pattern, s)), "")


def _first_sentence(cls: type) -> str:
    doc = _doc(cls)
    return re.split(r"(?<=\.)\s", doc, maxsplit=1)[0] if doc else ""


def field_help(cls: type, prefix: str = "", default: Any = dataclasses.MISSING) -> list[tuple]:
    """(dotted path, type, default, one line of meaning) of every settable field of
    dataclass `cls` (sections and their fields), as `--help` shows them. The default is
    the one a run gets (a section's default instance, e.g. the recipe's RLConfig, not
    RLConfig()'s); the meaning is the field's comment, else the sentence of the class
    docstring that names it, else (a section) its class's first sentence, else a
    pointer to the class."""
    if default is dataclasses.MISSING:
        try:
            default = cls()
        except TypeError:  # a section with required fields
            default = None
    hints = typing.get_type_hints(cls)
    comments = _comments(cls)
    rows: list[tuple] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path, tp = f"{prefix}{f.name}", hints[f.name]
        value = getattr(default, f.name, dataclasses.MISSING) if default is not None else None
        if value is dataclasses.MISSING:
            value = f.default if f.default is not dataclasses.MISSING else None
        sub = _section_class(tp)
        doc = comments.get(f.name) or _from_docstring(cls, f.name)
        if not doc and sub is not None:
            doc = _first_sentence(sub)
        if not doc:  # a library config's field its docstring does not name
            doc = f"a field of {cls.__name__} (see its docstring)"
        shown = "(section)" if dataclasses.is_dataclass(value) else repr(value)
        rows.append((path, _type_text(tp), shown, " ".join(doc.split())))
        if sub is not None:
            inner = value if dataclasses.is_dataclass(value) else dataclasses.MISSING
            rows += field_help(sub, path + ".", inner)
    return rows


def help_lines(cls: type, width: int = 120) -> list[str]:
    """`--help`'s lines: one per field, `--config.PATH  TYPE = DEFAULT  meaning` (the
    meaning cut to `width` characters)."""
    out = []
    for path, tp, default, doc in field_help(cls):
        head = f"  --config.{path}  {tp} = {default}"
        room = width - len(head) - 2
        text = doc if len(doc) <= room else doc[: max(room - 3, 0)].rstrip() + "..."
        out.append(f"{head}  {text}" if room > 10 else head)
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
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_text(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    if typing.get_origin(tp) is not None:
        return str(tp).replace("typing.", "")
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
