"""Logical axes: layers name what a dimension is; one rules table says where it goes.

A param (or activation) dimension carries a logical name from `LOGICAL_AXES`
(e.g. q_proj is ("embed", "heads")); `AxisRules` maps each logical name to
mesh axes, so a layer never names a mesh axis and one table re-shards every
model (MaxText's `logical_axis_rules`, flax's `logical_to_mesh_axes`):

    rules = AxisRules()                                   # DEFAULT_RULES
    rules.spec(("embed", "heads"), mesh)                  # P('fsdp', 'tensor')
    rules.fit(("vocab", "embed"), (50, 64), mesh, "embed_tokens")   # error: 50 % 4

Rules are in order of precedence: a dimension takes the first rule for its
name whose mesh axes are all in the mesh and unused by an earlier dimension
of the same array (else it is replicated). A mesh axis that does not divide
its dimension is an error naming the array, the axis and the sizes, unless
the rules say `indivisible="replicate"`: then the dimension is replicated
and the fallback is returned, to be counted (`training.core.sharding`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Sequence

from jax.sharding import PartitionSpec as P

__all__ = ["DEFAULT_RULES", "LOGICAL_AXES", "AxisRules", "Fallback", "active_rules", "axis_rules"]

# batch: rows of a batch; length: positions; layers: the stacked (scan) layer axis;
# embed: the model width; heads / kv: query / key-value heads x head_dim; mlp: the
# MLP's hidden width; vocab: the vocabulary; expert: MoE experts.
LOGICAL_AXES = ("batch", "length", "layers", "embed", "heads", "kv", "mlp", "vocab", "expert")

# The default mesh ('data', 'fsdp', 'tensor'): weights split over fsdp along the
# model width and over tensor along heads / MLP / vocab; rows over data x fsdp.
DEFAULT_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", ("fsdp",)),
    ("heads", ("tensor",)),
    ("kv", ("tensor",)),
    ("mlp", ("tensor",)),
    ("vocab", ("tensor",)),
    ("expert", ("expert",)),
    ("length", ()),
    ("layers", ()),
)
INDIVISIBLE = ("error", "replicate")


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A dimension replicated because its mesh axes do not divide it."""

    where: str
    dim: int
    logical: str
    mesh_axes: tuple[str, ...]
    size: int
    ways: int


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Logical axis name -> mesh axes (see the module docstring).

    table: (logical name, mesh axes) pairs in order of precedence; mesh axes
    () = replicated. indivisible: "error" (default) or "replicate".
    """

    table: tuple[tuple[str, tuple[str, ...]], ...] = DEFAULT_RULES
    indivisible: str = "error"

    def __post_init__(self):
        table = tuple(
            (
                str(name),
                tuple(axes)
                if isinstance(axes, (tuple, list))
                else (() if axes is None else (axes,)),
            )
            for name, axes in self.table
        )
        object.__setattr__(self, "table", table)
        unknown = sorted({name for name, _ in table} - set(LOGICAL_AXES))
        if unknown:
            raise ValueError(
                f"AxisRules: unknown logical axes {unknown}; the logical axes are {LOGICAL_AXES}"
            )
        if self.indivisible not in INDIVISIBLE:
            raise ValueError(
                f"AxisRules.indivisible must be one of {INDIVISIBLE}, got {self.indivisible!r}"
            )

    def spec(self, names: Sequence[str | None], mesh) -> P:
        """The PartitionSpec of logical `names` on `mesh` (divisibility not checked)."""
        used: set[str] = set()
        out = []
        for name in names:
            if name is not None and name not in LOGICAL_AXES:
                raise ValueError(
                    f"AxisRules: {name!r} is not a logical axis {LOGICAL_AXES}; "
                    "annotate arrays with logical names, not mesh axes"
                )
            entry = None
            for logical, axes in self.table:
                if logical == name and all(a in mesh.shape and a not in used for a in axes):
                    if axes:
                        entry = axes[0] if len(axes) == 1 else axes
                        used.update(axes)
                    break
            out.append(entry)
        return P(*out)

    def fit(
        self, names: Sequence[str | None], shape: Sequence[int], mesh, where: str
    ) -> tuple[P, list[Fallback]]:
        """(spec, fallbacks) of an array of `shape` with logical `names` on `mesh`.

        A mesh axis that does not divide its dimension raises ValueError (naming
        `where`, the logical and mesh axes and the sizes) or, with
        indivisible="replicate", replicates the dimension and lists it.
        """
        names = tuple(names) + (None,) * (len(shape) - len(tuple(names)))
        spec, fallbacks, out = self.spec(names, mesh), [], []
        for dim, (size, entry, name) in enumerate(zip(shape, tuple(spec), names, strict=True)):
            axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
            ways = math.prod(mesh.shape[a] for a in axes)
            if size % ways == 0:
                out.append(entry)
                continue
            if self.indivisible == "error":
                raise ValueError(
                    f"sharding {where}: dimension {dim} ({name!r}, size {size}) does not split "
                    f"over mesh axes {axes} ({ways} ways); pick a mesh whose {axes} size "
                    f"divides {size}, change the rules for {name!r} (AxisRules.table), or "
                    "replicate it knowingly with AxisRules(indivisible='replicate')"
                )
            fallbacks.append(Fallback(where, dim, str(name), axes, int(size), int(ways)))
            out.append(None)
        return P(*out), fallbacks


_ACTIVE: contextvars.ContextVar[AxisRules | None] = contextvars.ContextVar(
    "ac2_jax_axis_rules", default=None
)


@contextlib.contextmanager
def axis_rules(rules: AxisRules) -> Iterator[AxisRules]:
    """Within the block, models created under a mesh shard their params by `rules`."""
    token = _ACTIVE.set(rules)
    try:
        yield rules
    finally:
        _ACTIVE.reset(token)


def active_rules() -> AxisRules:
    """The rules of the innermost `axis_rules` block, else `AxisRules()` (DEFAULT_RULES)."""
    return _ACTIVE.get() or AxisRules()
