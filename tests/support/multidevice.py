"""Helpers to run a pure function under jit, pmap and a NamedSharding mesh."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

N_DEV = 8


def devices():
    devs = jax.devices()
    assert len(devs) >= N_DEV, f"needs {N_DEV} devices, got {len(devs)} (see tests/conftest.py)"
    return devs[:N_DEV]


def split_rows(tree):
    """[R, ...] leaves -> [8, R/8, ...] for pmap."""
    return jax.tree.map(lambda x: np.asarray(x).reshape((N_DEV, -1) + np.shape(x)[1:]), tree)


def run_pmap_rows(fn, *args):
    """pmap over row shards; `fn` gets an `axis_name` kwarg ("dev")."""
    out = jax.pmap(lambda *a: fn(*a, axis_name="dev"), axis_name="dev",
                   devices=devices())(*split_rows(args))
    return out


def run_pmap_replicated(fn, *args):
    """Every device runs `fn` on the same inputs; returns the 8 results."""
    rep = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (N_DEV,) + np.shape(x)), args)
    return jax.pmap(fn, devices=devices())(*rep)


def run_mesh_rows(fn, *args):
    """jit with every [R, ...] input sharded over rows on an 8-device mesh."""
    mesh = Mesh(np.array(devices()), ("data",))

    def shard(x):
        x = np.asarray(x)
        spec = P("data", *([None] * (x.ndim - 1))) if x.ndim else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    sharded = jax.tree.map(shard, args)
    out = jax.jit(fn)(*sharded)
    return out, sharded
