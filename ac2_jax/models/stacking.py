"""Layer layouts: stacked (`scan_layers=True`) <-> one entry per layer.

Params as pure dicts (`nnx.to_pure_dict`): stacked models hold
`{"layers": {<block params>: [num_layers, ...]}}`, per-layer models hold
`{"layers": {0: {...}, 1: {...}, ...}}` (keys may be str on disk). The
functions here move between the two with the same values, so checkpoints
of either layout load into a model of either layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from ac2_jax.models.decoder import Decoder


def is_stacked(params: dict) -> bool:
    """Whether a pure param dict has its layers stacked (no per-layer int keys)."""
    layers = params.get("layers", {})
    return not any(str(k).isdigit() for k in layers)


def stack_layers(params: dict, stack=jnp.stack) -> dict:
    """Per-layer pure params -> stacked ([num_layers, ...] leaves). Other entries kept."""
    if is_stacked(params):
        raise ValueError("stack_layers: the layers are stacked already (use to_layout)")
    layers = params["layers"]
    keys = sorted(layers, key=int)
    if [int(k) for k in keys] != list(range(len(keys))):
        raise ValueError(f"stack_layers: layer keys must be 0..n-1, got {keys}")
    stacked = jax.tree.map(lambda *xs: stack(xs), *[layers[k] for k in keys])
    return {**params, "layers": stacked}


def unstack_layers(params: dict) -> dict:
    """Stacked pure params -> {"layers": {i: layer i}} (int keys). Other entries kept."""
    if not is_stacked(params):
        raise ValueError("unstack_layers: the layers are per-layer already (use to_layout)")
    leaves = jax.tree.leaves(params["layers"])
    n = leaves[0].shape[0]
    per_layer = {i: jax.tree.map(lambda x, i=i: x[i], params["layers"]) for i in range(n)}
    return {**params, "layers": per_layer}


def to_layout(params: dict, stacked: bool) -> dict:
    """`params` in the stacked or per-layer layout (unchanged when already so)."""
    if is_stacked(params) == stacked:
        return params
    return stack_layers(params) if stacked else unstack_layers(params)


def with_layout(model: Decoder, scan_layers: bool, **changes) -> Decoder:
    """The same weights as a Decoder with `config.scan_layers = scan_layers` and any
    other config `changes` (e.g. remat, dtype; params cast to the new param_dtype).
    A new model; `model` is untouched."""
    config = model.config.replace(scan_layers=scan_layers, **changes)
    graphdef, params, *_ = nnx.split(nnx.eval_shape(lambda: Decoder(config)), nnx.Param, ...)
    values = to_layout(nnx.to_pure_dict(nnx.state(model, nnx.Param)), scan_layers)
    values = jax.tree.map(lambda a, x: jnp.asarray(x, a.dtype), nnx.to_pure_dict(params), values)
    nnx.replace_by_pure_dict(params, values)
    rest = nnx.state(model, nnx.Not(nnx.Param))  # not per layer (e.g. a LoRA bank's scales)
    return nnx.merge(graphdef, params, rest)
