"""Multi-host learners on JAX's own runtime: one process per host, one global mesh.

A multi-host run starts every process with `initialize(...)` (JAX's
`jax.distributed`: coordinator address, process count and id, or
auto-detection on TPU / SLURM / Kubernetes as JAX provides), builds the mesh
over `jax.devices()` (every process's devices) and gives each process only
its share of the batch:

    initialize()                                  # or explicit address / count / id
    mesh = make_mesh(data=jax.device_count())
    mine = process_share(segments)                # this process's segments
    local = pack_segments(mine, seq_len, all_tasks=all_names, segment_offset=offset)
    state, metrics = step(state, local)           # TrainStep assembles the global batch

`TrainStep` (with a mesh spanning processes) turns each process's rows into
one global array (`global_batch`: `jax.make_array_from_process_local_data`),
so the loss is the exact global-batch loss: the normalisers (`loss_weights`)
are computed inside the step over the global arrays, as they are across the
devices of one process. Task ids must mean the same task on every process
(`pack_segments(all_tasks=...)`); capacities and row counts are agreed
across processes here (the larger wins) before the arrays are built.
Orbax saves from every process and restores onto any process count or mesh
(`training.core.checkpoints`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ac2_jax.segments import PackedBatch, pad_batch_rows
from ac2_jax.training.core.sharding import batch_sharding, split_constraint_masks

T = TypeVar("T")


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    cpu_collectives: str = "gloo",
) -> None:
    """Starts JAX's multi-controller runtime (`jax.distributed.initialize`).

    With no arguments JAX detects the cluster (TPU pods, SLURM, Kubernetes /
    GKE). CPU devices' cross-process collectives need an implementation
    (gloo; set before any computation; accelerators ignore the setting).
    """
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
    )


def process_share(
    items: Sequence[T], process_index: int | None = None, process_count: int | None = None
) -> list[T]:
    """This process's items: every process_count-th one from process_index on
    (a deterministic split; every process sees the same full list)."""
    i = jax.process_index() if process_index is None else process_index
    n = jax.process_count() if process_count is None else process_count
    if not 0 <= i < n:
        raise ValueError(f"process_share: process_index {i} not in [0, {n})")
    return list(items[i::n])


def _agree(values: Sequence[int]) -> np.ndarray:
    """Element-wise max of an int vector over all processes."""
    local = np.asarray(values, np.int64)
    if jax.process_count() == 1:
        return local
    return np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(local)).max(0)


def _pad_rows(local, extra: int):
    """`extra` empty rows appended (a PackedBatch's by `pad_batch_rows`, other leaves zeros)."""
    if isinstance(local, PackedBatch):
        return pad_batch_rows(local, local.shape[0] + extra)
    return jax.tree.map(
        lambda x: np.concatenate(
            [np.asarray(x), np.zeros((extra, *np.shape(x)[1:]), np.asarray(x).dtype)]
        ),
        local,
    )


def global_batch(local, mesh: Mesh):
    """Each process's rows -> one global batch pytree on `mesh` (rows over the batch axes).

    local: a PackedBatch (or pytree of [rows, ...] host arrays) holding this
    process's rows. Row counts and the static capacities (num_tasks,
    num_segments) are agreed across processes first: the smaller are padded
    with empty rows / raised (empty rows and unused ids carry no loss), so
    every process compiles the same step. Global rows = agreed local rows x
    process count, in process order. A grammar-mask table (`constraint_masks`,
    with batch-wide ids: the same table on every process, as
    `training.rl.pack_rl_batch` builds it) is replicated, its capacity agreed.
    """
    local, table = split_constraint_masks(local)
    leaves = jax.tree.leaves(local)
    rows = int(np.shape(leaves[0])[0])
    caps = [getattr(local, "num_tasks", 0), getattr(local, "num_segments", 0)]
    masks = 0 if table is None else int(np.shape(table)[0])
    agreed_rows, tasks, segments, agreed_masks = (int(v) for v in _agree([rows] + caps + [masks]))
    if (table is None) != (agreed_masks == 0):
        raise ValueError(
            f"global_batch: process {jax.process_index()} has "
            f"{'no' if table is None else 'a'} grammar-mask table (constraint_masks) but "
            "another process differs; every share of one batch must carry the global "
            "table (training.rl.pack_rl_batch does)"
        )
    if agreed_rows > rows:
        local = _pad_rows(local, agreed_rows - rows)
    if hasattr(local, "replace") and hasattr(local, "num_tasks"):
        local = local.replace(num_tasks=tasks, num_segments=segments)
    sharding = batch_sharding(mesh)
    n = jax.process_count()

    def make(x):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(sharding, x, (x.shape[0] * n, *x.shape[1:]))

    out = jax.tree.map(make, local)
    if table is None:
        return out
    table = np.asarray(table)
    full = np.zeros((agreed_masks, *table.shape[1:]), table.dtype)
    full[: len(table)] = table
    replicated = NamedSharding(mesh, P())
    return out.replace(
        constraint_masks=jax.make_array_from_process_local_data(replicated, full, full.shape)
    )
