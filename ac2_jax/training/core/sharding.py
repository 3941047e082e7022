"""Meshes, NamedShardings of the train state, and pmap replication.

The mesh has axes ('data', 'fsdp', 'tensor'). Params follow the model's own
sharding names (`nnx.get_partition_spec`); optimizer moments follow their
param; batch rows split over ('data', 'fsdp'). A mesh axis that does not
divide a param dimension is dropped for that dimension (replicated), so any
mesh works with any model size.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh over the first data*fsdp*tensor devices."""
    devices = list(jax.devices() if devices is None else devices)
    n = data * fsdp * tensor
    if min(data, fsdp, tensor) < 1 or n > len(devices):
        raise ValueError(f"make_mesh: data={data} x fsdp={fsdp} x tensor={tensor} needs "
                         f"{n} devices (each >= 1); {len(devices)} available")
    return Mesh(np.asarray(devices[:n], dtype=object).reshape(data, fsdp, tensor), AXES)


def batch_ways(mesh: Mesh) -> int:
    """How many shards batch rows split into on this mesh."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES if a in mesh.shape)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over ('data', 'fsdp'), the rest replicated."""
    return NamedSharding(mesh, P(tuple(a for a in BATCH_AXES if a in mesh.shape)))


def fit_spec(spec: P, shape: tuple, mesh: Mesh) -> P:
    """`spec` with every mesh axis that does not divide its dimension dropped."""
    entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    out = []
    for dim, entry in zip(shape, entries):
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        for name in names:
            if name not in mesh.shape:
                raise ValueError(f"sharding: partition spec {spec} names axis {name!r}, "
                                 f"not in the mesh axes {tuple(mesh.shape)}")
        size = math.prod(mesh.shape[n] for n in names)
        out.append(entry if dim % size == 0 else None)
    return P(*out)


def param_shardings(params: nnx.State, mesh: Mesh):
    """NamedSharding per param (same tree), from the params' sharding names."""
    specs = nnx.get_partition_spec(params)
    return jax.tree.map(lambda spec, x: NamedSharding(mesh, fit_spec(spec, x.shape, mesh)),
                        specs, params, is_leaf=lambda s: isinstance(s, P))


def follow_params(tree, params, param_sh, default):
    """Shardings for `tree` (e.g. an optimizer state): a leaf whose key path ends
    with a param's path and has its shape gets that param's sharding."""
    by_path = {}
    for (path, x), sh in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                             jax.tree.leaves(param_sh)):
        by_path[tuple(path)] = (tuple(x.shape), sh)

    def pick(path, x):
        for i in range(len(path)):
            hit = by_path.get(tuple(path[i:]))
            if hit is not None and hit[0] == tuple(np.shape(x)):
                return hit[1]
        return default

    return jax.tree_util.tree_map_with_path(pick, tree)


def state_shardings(state, mesh: Mesh):
    """A TrainState (or its abstract shape) -> the same tree of NamedShardings."""
    rep = NamedSharding(mesh, P())
    psh = param_shardings(state.params, mesh)
    return state.replace(step=rep, params=psh,
                         opt_state=follow_params(state.opt_state, state.params, psh, rep),
                         rng=rep, rest=jax.tree.map(lambda _: rep, state.rest))


def shard_state(state, mesh: Mesh):
    """Places a TrainState on the mesh."""
    return jax.device_put(state, state_shardings(state, mesh))


def check_rows(rows: int, ways: int, grad_accum: int, where: str) -> None:
    if rows % grad_accum or (rows // grad_accum) % ways:
        raise ValueError(f"{where}: batch has {rows} rows; they must split into grad_accum="
                         f"{grad_accum} micro-batches of a multiple of {ways} rows (data-parallel "
                         f"shards); pack with rows_multiple={ways * grad_accum}")


def shard_batch(batch, mesh: Mesh):
    """Places a batch pytree (every leaf [rows, ...]) with rows over ('data', 'fsdp')."""
    rows = jax.tree.leaves(batch)[0].shape[0]
    check_rows(rows, batch_ways(mesh), 1, "shard_batch")
    return jax.device_put(batch, batch_sharding(mesh))


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
    """[rows, ...] -> [n, rows // n, ...] for every leaf (rows must divide)."""
    def f(x):
        if x.shape[0] % n:
            raise ValueError(f"split_rows: {x.shape[0]} rows do not split over {n} devices")
        return x.reshape(n, x.shape[0] // n, *x.shape[1:])
    return jax.tree.map(f, tree)


def merge_rows(tree):
    """Inverse of `split_rows`."""
    return jax.tree.map(lambda x: jnp.reshape(x, (-1, *x.shape[2:])), tree)
