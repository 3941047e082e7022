"""Meshes, NamedShardings of the train state, and (for the pure pieces under pmap)
replication.

The mesh has axes ('data', 'fsdp', 'tensor'). Params carry logical axis
names (`nnx.get_partition_spec`: "embed", "heads", ...) and one rules table
(`models.axes.AxisRules`, default `DEFAULT_RULES`) maps them to mesh axes;
optimizer moments follow their param; batch rows split over ('data',
'fsdp'). A mesh axis that does not divide its param dimension is an error
naming the param and the sizes, unless the rules say
indivisible="replicate": then the dimension is replicated and each fallback
is logged and counted (`state_shardings(..., fallbacks=[])`).
"""

from __future__ import annotations

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ac2_jax.models.axes import DEFAULT_RULES, AxisRules, Fallback

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = dict(DEFAULT_RULES)["batch"]  # the mesh axes batch rows split over


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh over the first data*fsdp*tensor devices."""
    devices = list(jax.devices() if devices is None else devices)
    n = data * fsdp * tensor
    if min(data, fsdp, tensor) < 1 or n > len(devices):
        raise ValueError(
            f"make_mesh: data={data} x fsdp={fsdp} x tensor={tensor} needs "
            f"{n} devices (each >= 1); {len(devices)} available"
        )
    return Mesh(np.asarray(devices[:n], dtype=object).reshape(data, fsdp, tensor), AXES)


def batch_ways(mesh: Mesh) -> int:
    """How many shards batch rows split into on this mesh."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.shape)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over ('data', 'fsdp'), the rest replicated."""
    return NamedSharding(mesh, P(tuple(a for a in BATCH_AXES if a in mesh.shape)))


def param_shardings(
    params: nnx.State,
    mesh: Mesh,
    rules: AxisRules | None = None,
    fallbacks: list[Fallback] | None = None,
):
    """NamedSharding per param (same tree), from the params' logical axis names and
    `rules` (default AxisRules()). Replicated dimensions of indivisible="replicate"
    rules are appended to `fallbacks` when given."""
    rules = AxisRules() if rules is None else rules
    found: list[Fallback] = []

    def one(path, spec, x):
        where = ".".join(
            str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
            for k in path
            if getattr(k, "name", None) != "value"
        )
        for name in tuple(spec):
            if name is not None and not isinstance(name, str):
                raise ValueError(
                    f"sharding {where}: annotate params with logical axis names "
                    f"(one per dimension), got {spec}"
                )
        out, fb = rules.fit(tuple(spec), x.shape, mesh, where)
        found.extend(fb)
        return NamedSharding(mesh, out)

    specs = nnx.get_partition_spec(params)
    tree = jax.tree_util.tree_map_with_path(one, specs, params, is_leaf=lambda s: isinstance(s, P))
    if found:
        logging.warning(
            "sharding: %d param dimensions replicated because their mesh axes do "
            "not divide them (AxisRules(indivisible='replicate')): %s",
            len(found),
            ", ".join(f"{f.where}[{f.dim}] {f.size} over {f.mesh_axes}" for f in found[:8]),
        )
    if fallbacks is not None:
        fallbacks.extend(found)
    return tree


def follow_params(tree, params, param_sh, default):
    """Shardings for `tree` (e.g. an optimizer state): a leaf whose key path ends
    with a param's path and has its shape gets that param's sharding."""
    by_path = {}
    for (path, x), sh in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(param_sh), strict=True
    ):
        by_path[tuple(path)] = (tuple(x.shape), sh)

    def pick(path, x):
        for i in range(len(path)):
            hit = by_path.get(tuple(path[i:]))
            if hit is not None and hit[0] == tuple(np.shape(x)):
                return hit[1]
        return default

    return jax.tree_util.tree_map_with_path(pick, tree)


def state_shardings(
    state, mesh: Mesh, rules: AxisRules | None = None, fallbacks: list[Fallback] | None = None
):
    """A TrainState (or its abstract shape) -> the same tree of NamedShardings
    (params by `rules`, see `param_shardings`; the variables that do not train,
    `rest`, e.g. a LoRA model's frozen base, by their names likewise, so each
    device holds its share of them, not a copy)."""
    rep = NamedSharding(mesh, P())
    psh = param_shardings(state.params, mesh, rules, fallbacks)
    rest = (
        param_shardings(state.rest, mesh, rules, fallbacks)
        if jax.tree.leaves(state.rest)
        else jax.tree.map(lambda _: rep, state.rest)
    )
    return state.replace(
        step=rep,
        params=psh,
        opt_state=follow_params(state.opt_state, state.params, psh, rep),
        rng=rep,
        rest=rest,
    )


def shard_state(state, mesh: Mesh, rules: AxisRules | None = None):
    """Places a TrainState on the mesh (params by `rules`)."""
    return jax.device_put(state, state_shardings(state, mesh, rules))


def check_rows(rows: int, ways: int, grad_accum: int, where: str) -> None:
    if rows % grad_accum or (rows // grad_accum) % ways:
        raise ValueError(
            f"{where}: batch has {rows} rows; they must split into grad_accum="
            f"{grad_accum} micro-batches of a multiple of {ways} rows (data-parallel "
            f"shards); pack with rows_multiple={ways * grad_accum}"
        )


def split_constraint_masks(batch):
    """(batch without its grammar-mask table, the table or None). The table
    (`PackedBatch.constraint_masks` [K, W]) is the one leaf of a batch that is not
    [rows, ...]: it goes whole (replicated) to every device and micro-batch."""
    table = getattr(batch, "constraint_masks", None)
    if table is None:
        return batch, None
    return batch.replace(constraint_masks=None), table


def place_batch(tree, mesh: Mesh):
    """Places a batch pytree on `mesh`: every [rows, ...] leaf with rows over
    ('data', 'fsdp'); a PackedBatch's constraint_masks table replicated."""

    def put(t):
        rows, table = split_constraint_masks(t)
        placed = jax.device_put(rows, batch_sharding(mesh))
        if table is None:
            return placed
        return placed.replace(constraint_masks=jax.device_put(table, NamedSharding(mesh, P())))

    return jax.tree.map(put, tree, is_leaf=lambda t: hasattr(t, "constraint_masks"))


def shard_batch(batch, mesh: Mesh):
    """Places a batch pytree (every leaf [rows, ...], except a PackedBatch's
    constraint_masks, replicated) with rows over ('data', 'fsdp')."""
    rows = jax.tree.leaves(split_constraint_masks(batch)[0])[0].shape[0]
    check_rows(rows, batch_ways(mesh), 1, "shard_batch")
    return place_batch(batch, mesh)


# ----------------------------------------------------------------------------- pmap


def replicate(tree, devices=None):
    """Copies every leaf to each device, stacked on a new leading axis (pmap input)."""
    devices = list(jax.local_devices() if devices is None else devices)
    n = len(devices)
    sharding = NamedSharding(Mesh(np.asarray(devices, dtype=object), ("replica",)), P("replica"))

    def put(x):
        x = np.asarray(x)
        return jax.device_put(np.broadcast_to(x, (n, *x.shape)), sharding)

    return jax.tree.map(put, tree)


def unreplicate(tree):
    """The first device's copy of a replicated pytree."""
    return jax.tree.map(lambda x: x[0], tree)


def split_rows(tree, n: int):
    """[rows, ...] -> [n, rows // n, ...] for every leaf (rows must divide).

    A PackedBatch with grammar masks is refused: its `constraint_masks` table is
    not row-aligned (each device needs all of it); the train step (`TrainStep`,
    jit over a mesh) places it whole."""
    if getattr(tree, "constraint_masks", None) is not None:
        raise ValueError(
            "split_rows: this PackedBatch carries constraint_masks, a table every device "
            "needs whole, not rows to split; train it with TrainStep (jit over a mesh)"
        )

    def f(x):
        if x.shape[0] % n:
            raise ValueError(f"split_rows: {x.shape[0]} rows do not split over {n} devices")
        return x.reshape(n, x.shape[0] // n, *x.shape[1:])

    return jax.tree.map(f, tree)


def merge_rows(tree):
    """Inverse of `split_rows`."""
    return jax.tree.map(lambda x: jnp.reshape(x, (-1, *x.shape[2:])), tree)
