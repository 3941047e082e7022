"""Orbax I/O of model params, and the learner -> sampler publish protocol.

Publishing: `publish_dir` is an Orbax CheckpointManager directory holding
params only (item "params", step = policy version). Orbax writes each step
into a temporary directory and renames it when complete, and lists only
finalized steps, so a reader (`latest_published`, `load_published`) never
sees a half-written step. The manager keeps the newest `keep` steps.

A model with LoRA adapters (`models.lora`) publishes its adapters alone (the
trained part: `trainable_filter`) plus the adapters' config (item "lora"): a
sampler that holds the same base loads them with `load_published`, or into a
bank slot with `read_published_adapter` + `peft_io.write_slot`.

Params are saved in the model's own layer layout; restoring converts a
checkpoint of the other layout (stacked `scan_layers` <-> per-layer) on the
way in, so a scanned learner can publish to a per-layer sampler and back.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from ac2_jax.models.lora import LoRAConfig, trainable_filter
from ac2_jax.models.stacking import is_stacked, to_layout

PARAMS = "params"  # the params item of a publish step
LORA = "lora"  # a LoRA model's step also holds its LoRAConfig (JSON)
CHECKSUM = "checksum"  # every publish step holds the checksum of its params (JSON)


def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler())


def _params(model: nnx.Module) -> dict:
    """What is saved and published: every Param, or a LoRA model's adapters alone."""
    return nnx.to_pure_dict(nnx.state(model, trainable_filter(model)))


def _lora_config(model: nnx.Module) -> LoRAConfig | None:
    config = getattr(model, "config", None)
    lora = getattr(config, "lora", None)
    return lora if trainable_filter(model) is nnx.LoRAParam else None


def _bits_sum(x: jax.Array, lead: int) -> jax.Array:
    """uint32 [x.shape[:lead]]: sum of x's bf16 bit patterns, each times its position
    mod 65521 plus 1, over the trailing axes (wrapping: exact in any order, so any
    sharding of x gives the same value)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
    inner = bits.reshape(*x.shape[:lead], -1)
    w = jnp.arange(inner.shape[-1], dtype=jnp.uint32) % 65521 + 1
    return jnp.sum(inner * w, axis=-1, dtype=jnp.uint32)


@functools.partial(jax.jit, static_argnums=1)
def _leaf_sums(leaves: list, leads: tuple[int, ...]) -> list:
    """`_bits_sum` of every leaf in one compiled call (one compile per tree of shapes)."""
    return [_bits_sum(x, lead) for x, lead in zip(leaves, leads, strict=True)]


def weights_checksum(model_or_params) -> str:
    """A cheap deterministic checksum of what a publish holds (`publish_weights`: every
    Param, or a LoRA model's adapters alone): 16 hex digits.

    Per leaf, a position-weighted wrapping sum of its values' bf16 bit patterns,
    reduced on the leaf's device(s); the leaf sums are hashed (sha256) with their
    paths on the host. bf16 because a sampler may serve the published fp32 weights
    cast to bf16 (the same rounding), and it is the same for the stacked and the
    per-layer layout (a stacked leaf is summed per layer). Equal weights give equal
    checksums on any device or sharding; weights that differ in any bf16 value give
    another checksum except by a 2^-32-scale coincidence per leaf. Takes a model or
    a pure params dict (as `_params` gives)."""
    params = (
        _params(model_or_params) if isinstance(model_or_params, nnx.Module) else model_or_params
    )
    stacked = is_stacked(params) if isinstance(params, dict) else False
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    names = [[str(getattr(p, "key", getattr(p, "idx", p))) for p in path] for path, _ in flat]
    leads = tuple(
        int(stacked and keys[:1] == ["layers"] and getattr(leaf, "ndim", 0) >= 1)
        for keys, (_, leaf) in zip(names, flat, strict=True)
    )
    got = jax.device_get(_leaf_sums([jnp.asarray(leaf) for _, leaf in flat], leads))
    items: list[tuple[str, int]] = []
    for keys, lead, sums in zip(names, leads, got, strict=True):
        if lead:
            items += [(".".join(["layers", str(i), *keys[1:]]), int(v)) for i, v in enumerate(sums)]
        else:
            items.append((".".join(keys), int(sums)))
    digest = hashlib.sha256()
    for key, value in sorted(items):
        digest.update(f"{key}:{value};".encode())
    return digest.hexdigest()[:16]


def save_params(model: nnx.Module, path: str, overwrite: bool = False) -> None:
    """Writes the model's params (nnx.Param leaves) as an Orbax checkpoint at `path`."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"save_params: {path} exists; pass overwrite=True to replace it")
    _checkpointer().save(path, args=ocp.args.PyTreeSave(_params(model)), force=overwrite)


def restore_params(model: nnx.Module, path: str) -> None:
    """Loads params saved by `save_params` into `model` in place.

    Arrays land with the shapes, dtypes and shardings the model has now; a
    checkpoint of a different architecture is an error.
    """
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"restore_params: no checkpoint at {path}")
    ckpt = _checkpointer()
    _restore_into(
        model,
        ckpt.metadata(path),
        lambda target: ckpt.restore(path, args=_partial_restore(target)),
        path,
    )


def _restore_into(model: nnx.Module, meta, restore, where: str) -> None:
    """Checks the saved tree (`meta`) against the model's params, then loads
    `restore(target)` into the model (target: ShapeDtypeStructs with shardings)."""
    state = nnx.state(model, trainable_filter(model))
    pure = nnx.to_pure_dict(state)
    meta = getattr(meta, "item_metadata", meta)  # StepMetadata wraps the TreeMetadata
    saved = getattr(meta, "tree", meta)
    stacked = is_stacked(pure)
    saved_stacked = is_stacked(saved) if "layers" in pure and "layers" in saved else stacked
    if saved_stacked == stacked:
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
            pure,
        )
        _check_matches(saved, target, where)
        values = _restore_in_groups(restore, target)
    else:  # the other layer layout: restore replicated as saved, convert, place
        first = jax.tree.leaves(pure)[0].sharding
        rep = (
            jax.sharding.NamedSharding(first.mesh, jax.sharding.PartitionSpec())
            if isinstance(first, jax.sharding.NamedSharding)
            else first
        )
        other = jax.eval_shape(lambda p: to_layout(p, saved_stacked), pure)
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), other)
        _check_matches(saved, target, where)
        values = jax.tree.map(
            lambda v, x: jax.device_put(v, x.sharding),
            to_layout(_restore_in_groups(restore, target), stacked),
            pure,
        )
    nnx.replace_by_pure_dict(state, values)
    nnx.update(model, state)


GROUP_BYTES = 256 * 2**20  # params restored per Orbax call (`_restore_in_groups`)


def _skipped(x) -> bool:
    """A leaf a partial restore leaves out."""
    return x is ocp.PLACEHOLDER


def _partial_restore(target) -> ocp.args.PyTreeRestore:
    """Orbax restore args for `target`: ShapeDtypeStructs (with shardings) are read,
    `ocp.PLACEHOLDER` leaves are skipped."""
    args = jax.tree.map(
        lambda x: (
            x
            if _skipped(x)
            else ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape, dtype=x.dtype)
        ),
        target,
        is_leaf=_skipped,
    )
    return ocp.args.PyTreeRestore(item=target, restore_args=args)


def _restore_in_groups(restore, target):
    """`restore(target)` a group of about GROUP_BYTES of params at a time (the other
    leaves `ocp.PLACEHOLDER`), so a load holds the model's current params, the new
    ones and one group of Orbax's read buffers, not a second copy of everything
    (0.6B-1.7B shapes: a full publish loaded at ~2.5x the params on top,
    docs/notes/2026-12-05-lora-memory-time-publish-real-size.md). Nothing reaches the
    model until every group is read: `_restore_into` swaps them in at once."""
    leaves, treedef = jax.tree_util.tree_flatten(target)
    groups: list[list[int]] = [[]]
    size = 0
    for i, x in enumerate(leaves):
        nbytes = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        if groups[-1] and size + nbytes > GROUP_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    values: list = [None] * len(leaves)
    for group in groups:
        wanted = set(group)
        part = [x if i in wanted else ocp.PLACEHOLDER for i, x in enumerate(leaves)]
        got = jax.tree_util.tree_leaves(
            restore(jax.tree_util.tree_unflatten(treedef, part)), is_leaf=_skipped
        )
        for i in group:
            values[i] = got[i]
        del got
    return jax.tree_util.tree_unflatten(treedef, values)


def _check_matches(saved, target, path: str) -> None:
    """Names the first param whose presence or shape differs (before reading any data)."""

    def flat(tree):  # int layer keys in the model are str keys on disk
        return {
            ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in k): v
            for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]
        }

    flat_saved, flat_target = flat(saved), flat(target)
    for name in sorted(set(flat_saved) | set(flat_target)):
        if name not in flat_saved or name not in flat_target:
            where = "checkpoint" if name not in flat_saved else "model"
            raise ValueError(
                f"restore_params: param {name} is missing from the {where} (checkpoint at {path})"
            )
        if tuple(flat_saved[name].shape) != tuple(flat_target[name].shape):
            raise ValueError(
                f"restore_params: param {name} has shape "
                f"{tuple(flat_saved[name].shape)} in {path}, the model has "
                f"{tuple(flat_target[name].shape)}"
            )


class _ReadOnlyNotice(logging.Filter):
    """Drops Orbax's "Given directory is read only" warning: samplers read the publish
    folder read-only on purpose (the learner alone writes it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Given directory is read only")


logging.getLogger("absl").addFilter(_ReadOnlyNotice())


def _manager(
    publish_dir: str, keep: int | None = None, read_only: bool = False
) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        create=not read_only,
        read_only=read_only,
        save_interval_steps=0 if read_only else 1,
        enable_async_checkpointing=False,
    )
    handlers = {
        PARAMS: ocp.PyTreeCheckpointHandler(),
        LORA: ocp.JsonCheckpointHandler(),
        CHECKSUM: ocp.JsonCheckpointHandler(),
    }
    return ocp.CheckpointManager(publish_dir, options=options, item_handlers=handlers)


def publish_weights(model: nnx.Module, publish_dir: str, step: int, keep: int = 3) -> str:
    """Publishes the params (a LoRA model's adapters alone) as `step`; returns the
    step's directory.

    Publishing a step at or below the latest replaces it and deletes the
    newer steps first (a run resumed from an earlier checkpoint rolls the
    policy back; readers never see the abandoned steps again). The newest
    `keep` steps stay on disk. Every process takes part in the save (Orbax
    coordinates them).
    """
    return publish_params(_params(model), publish_dir, step, keep, _lora_config(model))


def published_params(model: nnx.Module) -> dict:
    """What `publish_weights` writes of `model`, as a pure dict: every Param, or a LoRA
    model's adapters alone. The model's own arrays (no copy): `assign_params` hands
    them to another model in memory, as `load_published` would from disk."""
    return _params(model)


def published_lora(model: nnx.Module) -> LoRAConfig | None:
    """The LoRAConfig a publish of `model` records (its adapters are what it publishes),
    None when it publishes every Param."""
    return _lora_config(model)


def publish_params(
    params: dict, publish_dir: str, step: int, keep: int = 3, lora: LoRAConfig | None = None
) -> str:
    """`publish_weights` of a pure dict (`published_params`; `lora`: the adapters'
    config when `params` are a LoRA model's adapters), e.g. from a thread that holds
    a copy of the learner's params while the learner goes on."""
    if isinstance(step, bool) or int(step) != step or step < 0:
        raise ValueError(f"publish_weights: step must be an int >= 0, got {step!r}")
    if keep < 1:
        raise ValueError(f"publish_weights: keep must be >= 1, got {keep}")
    step = int(step)
    publish_dir = os.path.abspath(publish_dir)
    with _manager(publish_dir, keep=keep) as mgr:
        for newer in sorted((s for s in mgr.all_steps() if s >= step), reverse=True):
            mgr.delete(newer)
        items = {
            PARAMS: ocp.args.PyTreeSave(params),
            CHECKSUM: ocp.args.JsonSave({"checksum": weights_checksum(params)}),
        }
        if lora is not None:
            items[LORA] = ocp.args.JsonSave(lora.to_dict())
        mgr.save(step, force=True, args=ocp.args.Composite(**items))
        mgr.wait_until_finished()
    return os.path.join(publish_dir, str(step))


_READERS: dict[str, ocp.CheckpointManager] = {}
_READERS_LOCK = threading.Lock()


@contextlib.contextmanager
def _reader(publish_dir: str):
    """This process's read-only manager of `publish_dir`, reloaded from disk (one
    per directory, used under a lock: any thread may load weights)."""
    with _READERS_LOCK:
        if publish_dir not in _READERS:
            _READERS[publish_dir] = _manager(publish_dir, read_only=True)
        mgr = _READERS[publish_dir]
        mgr.reload()
        yield mgr


def published_steps(publish_dir: str) -> list[int]:
    """The finalized steps in `publish_dir`, oldest first ([] when none)."""
    publish_dir = os.path.abspath(publish_dir)
    if not os.path.isdir(publish_dir):
        return []
    with _reader(publish_dir) as mgr:
        return sorted(mgr.all_steps())


def published_checksum(publish_dir: str, step: int) -> str | None:
    """The `weights_checksum` published with `step` (None for a step published before
    publishes carried one)."""
    publish_dir = os.path.abspath(publish_dir)
    if not os.path.isdir(os.path.join(publish_dir, str(step), CHECKSUM)):
        return None
    with _reader(publish_dir) as mgr:
        got = mgr.restore(int(step), args=ocp.args.Composite(**{CHECKSUM: ocp.args.JsonRestore()}))
    return got[CHECKSUM]["checksum"]


def latest_published(publish_dir: str) -> int | None:
    """The newest finalized step, or None when nothing was published yet."""
    steps = published_steps(publish_dir)
    return steps[-1] if steps else None


def load_published(model: nnx.Module, publish_dir: str, step: int | None = None) -> int:
    """Loads published params into `model` in place (the latest when step is None);
    returns the step loaded."""
    publish_dir = os.path.abspath(publish_dir)
    if not os.path.isdir(publish_dir):
        raise FileNotFoundError(
            f"load_published: nothing published in {publish_dir} (no such directory)"
        )
    with _reader(publish_dir) as mgr:
        steps = sorted(mgr.all_steps())
        if not steps:
            raise FileNotFoundError(
                f"load_published: nothing published in {publish_dir} (no finalized step)"
            )
        step = steps[-1] if step is None else int(step)
        if step not in steps:
            raise FileNotFoundError(
                f"load_published: step {step} is not in {publish_dir} (kept steps: {steps})"
            )
        where = f"step {step} of {publish_dir}"
        _restore_into(
            model,
            mgr.item_metadata(step)[PARAMS],
            lambda target: mgr.restore(
                step, args=ocp.args.Composite(**{PARAMS: _partial_restore(target)})
            )[PARAMS],
            where,
        )
    return step


def assign_params(model: nnx.Module, params: dict, where: str = "in-memory weights") -> None:
    """Loads `params` (a pure dict as `published_params` gives: every Param, or a LoRA
    model's adapters alone) into `model` in place, as `load_published` loads a publish
    of them: the same names and shapes are required (ValueError naming the first that
    differs), the other layer layout (stacked <-> per-layer) is converted, and each
    value is cast to the model's dtype for it and placed on the model's sharding for
    it. Always a copy: the model never shares a buffer with `params`, so the caller
    may donate or delete them afterwards (a train step donates its state). On the
    same device no host transfer happens."""
    state = nnx.state(model, trainable_filter(model))
    pure = nnx.to_pure_dict(state)
    params = _int_keys(params)
    stacked = is_stacked(pure)
    given = is_stacked(params) if "layers" in pure and "layers" in params else stacked
    if given != stacked:
        params = to_layout(params, stacked)
    _check_matches(params, pure, where)

    def put(v, x):
        v = jnp.asarray(v)
        if v.dtype == x.dtype:
            return jax.device_put(v, x.sharding, may_alias=False)
        return jax.device_put(v.astype(x.dtype), x.sharding)  # astype made a new array

    values = jax.tree.map(put, params, pure)
    nnx.replace_by_pure_dict(state, values)
    nnx.update(model, state)


def read_published_adapter(
    publish_dir: str, step: int | None = None
) -> tuple[dict, LoRAConfig, int]:
    """(adapters as a pure dict of numpy arrays, their LoRAConfig, step) of a step a
    LoRA model published (the latest when step is None), e.g. for a bank slot
    (`peft_io.write_slot`). ValueError if the step holds a full model."""
    publish_dir = os.path.abspath(publish_dir)
    with _reader(publish_dir) as mgr:
        steps = sorted(mgr.all_steps())
        if not steps:
            raise FileNotFoundError(f"read_published_adapter: nothing published in {publish_dir}")
        step = steps[-1] if step is None else int(step)
        if step not in steps:
            raise FileNotFoundError(
                f"read_published_adapter: step {step} is not in {publish_dir} (kept: {steps})"
            )
        if not os.path.isdir(os.path.join(publish_dir, str(step), LORA)):
            raise ValueError(
                f"read_published_adapter: step {step} of {publish_dir} holds a full model, "
                "not LoRA adapters"
            )
        got = mgr.restore(
            step,
            args=ocp.args.Composite(
                **{PARAMS: ocp.args.PyTreeRestore(), LORA: ocp.args.JsonRestore()}
            ),
        )
    params = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), _int_keys(got[PARAMS]))
    return params, LoRAConfig(**dict(got[LORA])), step


def _int_keys(tree):
    """A restored pure dict with its layer keys ("0", "1", ... on disk) as ints."""
    if not isinstance(tree, dict):
        return tree
    return {int(k) if str(k).isdigit() else k: _int_keys(v) for k, v in tree.items()}
