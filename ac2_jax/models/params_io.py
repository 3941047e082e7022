"""Orbax I/O of model params, and the learner -> sampler publish protocol.

Publishing: `publish_weights` writes an Orbax checkpoint of the params to
`publish_dir/<step>` (Orbax finalizes it atomically), then atomically
replaces `publish_dir/LATEST` (temp file + os.replace) with
`{"step": step, "path": "<step>"}` (path relative to publish_dir). A reader
that sees LATEST therefore always finds a complete checkpoint. Only the
newest `keep` steps stay on disk (the one LATEST names is never removed).
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import orbax.checkpoint as ocp
from flax import nnx

LATEST = "LATEST"


def _checkpointer() -> ocp.Checkpointer:
    return ocp.Checkpointer(ocp.StandardCheckpointHandler())


def _params(model: nnx.Module) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def save_params(model: nnx.Module, path: str, overwrite: bool = False) -> None:
    """Writes the model's params (nnx.Param leaves) as an Orbax checkpoint at `path`."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"save_params: {path} exists; pass overwrite=True to replace it")
    _checkpointer().save(path, _params(model), force=overwrite)


def restore_params(model: nnx.Module, path: str) -> None:
    """Loads params saved by `save_params` into `model` in place.

    Arrays land with the shapes, dtypes and shardings the model has now; a
    checkpoint of a different architecture is an error.
    """
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"restore_params: no checkpoint at {path}")
    state = nnx.state(model, nnx.Param)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        nnx.to_pure_dict(state))
    ckpt = _checkpointer()
    meta = ckpt.metadata(path)
    meta = getattr(meta, "item_metadata", meta)  # StepMetadata wraps the TreeMetadata
    _check_matches(meta.tree, target, path)
    restored = ckpt.restore(path, target)
    nnx.replace_by_pure_dict(state, restored)
    nnx.update(model, state)


def _check_matches(saved, target, path: str) -> None:
    """Names the first param whose presence or shape differs (before reading any data)."""
    def flat(tree):  # int layer keys in the model are str keys on disk
        return {".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in k): v
                for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}

    flat_saved, flat_target = flat(saved), flat(target)
    for name in sorted(set(flat_saved) | set(flat_target)):
        if name not in flat_saved or name not in flat_target:
            where = "checkpoint" if name not in flat_saved else "model"
            raise ValueError(f"restore_params: param {name} is missing from the {where} "
                             f"(checkpoint at {path})")
        if tuple(flat_saved[name].shape) != tuple(flat_target[name].shape):
            raise ValueError(f"restore_params: param {name} has shape "
                             f"{tuple(flat_saved[name].shape)} in {path}, the model has "
                             f"{tuple(flat_target[name].shape)}")


def _steps(publish_dir: str) -> list[int]:
    if not os.path.isdir(publish_dir):
        return []
    return sorted(int(n) for n in os.listdir(publish_dir)
                  if n.isdigit() and os.path.isdir(os.path.join(publish_dir, n)))


def _read_latest(publish_dir: str) -> dict | None:
    try:
        with open(os.path.join(publish_dir, LATEST)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def publish_weights(model: nnx.Module, publish_dir: str, step: int, keep: int = 3) -> str:
    """Publishes the params as `step`; returns the checkpoint path.

    Re-publishing an existing step replaces it. Every process takes part in
    the Orbax save; process 0 alone writes LATEST and prunes old steps.
    """
    if int(step) != step or step < 0:
        raise ValueError(f"publish_weights: step must be an int >= 0, got {step!r}")
    if keep < 1:
        raise ValueError(f"publish_weights: keep must be >= 1, got {keep}")
    step = int(step)
    publish_dir = os.path.abspath(publish_dir)
    os.makedirs(publish_dir, exist_ok=True)
    path = os.path.join(publish_dir, str(step))
    save_params(model, path, overwrite=True)
    if jax.process_index() == 0:
        tmp = os.path.join(publish_dir, f".{LATEST}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            json.dump({"step": step, "path": str(step)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(publish_dir, LATEST))
        for old in _steps(publish_dir)[:-keep]:
            if old != step:
                shutil.rmtree(os.path.join(publish_dir, str(old)), ignore_errors=True)
    return path


def latest_published(publish_dir: str) -> int | None:
    """The step LATEST names, or None when nothing was published yet."""
    info = _read_latest(os.path.abspath(publish_dir))
    return None if info is None else int(info["step"])


def load_published(model: nnx.Module, publish_dir: str, step: int | None = None) -> int:
    """Loads published params into `model` in place (the latest when step is None)."""
    publish_dir = os.path.abspath(publish_dir)
    if step is None:
        info = _read_latest(publish_dir)
        if info is None:
            raise FileNotFoundError(f"load_published: nothing published in {publish_dir} "
                                    f"(no {LATEST} file)")
        step, rel = int(info["step"]), info["path"]
    else:
        rel = str(int(step))
    path = os.path.join(publish_dir, rel)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_published: step {step} is not in {publish_dir} "
                                f"(kept steps: {_steps(publish_dir)})")
    restore_params(model, path)
    return int(step)
