"""Orbax checkpoints of the train state, and publishing weights to the sampler.

A checkpoint holds the whole TrainState (params, optimizer state, step, RNG
key) and a JSON `data` position (where the data stream is), so a resumed run
takes exactly the step an uninterrupted one would. The state is stored as a
nested dict keyed by its pytree paths ('params/layers/0/mlp/up_proj/value'),
which keeps the files independent of the pytree classes, and restored onto
whatever shardings the target carries (another mesh, one device, or host
followed by `TrainStep.place`).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import SingleDeviceSharding


def _key_str(k) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _path(path) -> tuple[str, ...]:
    return tuple(_key_str(k) for k in path)


def to_nested(tree) -> dict:
    """Pytree -> nested dict of its leaves keyed by path components."""
    out: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = _path(path)
        if not keys:
            raise ValueError("checkpoints: the state must be a container, not a bare array")
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        if keys[-1] in node:
            raise ValueError(f"checkpoints: two leaves share the path {'/'.join(keys)}")
        node[keys[-1]] = leaf
    return out


def from_nested(nested: dict, like):
    """Inverse of `to_nested`: the leaves of `nested` in the structure of `like`."""
    leaves = []
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    for path, _ in paths:
        node = nested
        for k in _path(path):
            if not isinstance(node, dict) or k not in node:
                raise KeyError(
                    f"checkpoints: the checkpoint has no entry "
                    f"{'/'.join(_path(path))}; does the model/optimizer match?"
                )
            node = node[k]
        leaves.append(node)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def abstract_target(target, shardings=None):
    """ShapeDtypeStructs (with shardings) to restore into.

    target: a state or its abstract shape (`jax.eval_shape`). shardings: a
    matching tree of shardings; default: each leaf's own sharding if it has
    one, else the first local device.
    """
    default = SingleDeviceSharding(jax.local_devices()[0])
    if shardings is None:
        shardings = jax.tree.map(lambda x: getattr(x, "sharding", None) or default, target)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), target, shardings
    )


class Checkpointer:
    """Orbax CheckpointManager over (state, data): async save, keep the newest N.

    save(step, state, data) returns at once (async); `wait()` blocks until the
    files are complete; `close()` before the process exits.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        save_interval_steps: int = 1,
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"Checkpointer: max_to_keep must be >= 1 or None, got {max_to_keep}")
        self.directory = os.path.abspath(os.fspath(directory))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "data")
        )

    def save(self, step: int, state, data: dict | None = None, *, force: bool = False) -> bool:
        """Saves the (global, possibly sharded) state.
        Returns whether a save started (see save_interval_steps)."""
        return self.manager.save(
            int(step),
            force=force,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(to_nested(state)),
                data=ocp.args.JsonSave(dict(data or {})),
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def restore(self, target, step: int | None = None, *, shardings=None):
        """(state, data, step) of `step` (default: the latest).

        target: a state or abstract state of the same model and optimizer;
        values land on `shardings` (default: the target's own), so a
        checkpoint saved on one mesh restores onto any other.
        """
        step = self.latest_step() if step is None else int(step)
        if step is None:
            raise FileNotFoundError(f"Checkpointer: no checkpoint in {self.directory}")
        abstract = to_nested(abstract_target(target, shardings))
        try:
            out = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()
                ),
            )
        except ValueError as e:
            raise ValueError(
                f"Checkpointer.restore: step {step} in {self.directory} does not "
                f"match the target state (model or optimizer differ?): {e}"
            ) from e
        return from_nested(out["state"], target), dict(out["data"] or {}), step

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def publish(
    graphdef,
    state,
    publish_dir: str | os.PathLike,
    step: int | None = None,
    keep: int = 3,
    *,
    sampler: Any = None,
    in_memory: bool = False,
) -> str:
    """Writes the state's weights as the sampler's next policy; returns the path.
    The library's one publish verb.

    Uses `ac2_jax.models.io.params_io.publish_weights` (an Orbax
    CheckpointManager directory of params: readers only see finalized steps,
    newest `keep` kept). step defaults to state.step.

    sampler: also hands the weights to this sampler (one built on `publish_dir`),
    whose `policy_version` is then `step`: it reloads the publish
    (`load_weights`), or with `in_memory` takes the learner's params directly
    (`JaxSampler.set_params`, the same weights: `SamplerConfig.hand_off="memory"`);
    the folder is written either way (resume, other readers).
    """
    from ac2_jax.models.io import params_io

    if in_memory and sampler is None:
        raise ValueError("publish: in_memory=True hands the weights to a sampler; pass sampler=")
    set_params = getattr(sampler, "set_params", None)
    if in_memory and not callable(set_params):
        raise TypeError(
            f"publish: in_memory needs a sampler that takes params (JaxSampler.set_params); "
            f"{type(sampler).__name__} has none: leave in_memory False to reload the publish"
        )
    step = int(jax.device_get(state.step)) if step is None else int(step)
    model = state.model(graphdef)  # merged once: the write and the hand-off read it
    path = params_io.publish_weights(model, os.fspath(publish_dir), step, keep=keep)
    if in_memory:
        assert set_params is not None  # checked above, before any write
        set_params(params_io.published_params(model), step)
    elif sampler is not None:
        sampler.load_weights(step)
    return path
