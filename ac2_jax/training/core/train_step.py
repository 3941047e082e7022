"""The train step: one pure function, jitted over a mesh.

Params and optimizer state are sharded by the model's logical axes
(`models.axes`, mapped to the mesh's ('data', 'fsdp', 'tensor') axes), batch
rows split over ('data', 'fsdp'); GSPMD inserts the collectives. One device is
a one-device mesh: there is one compiled path. The pure pieces
(`loss_and_grads`, `fill_micro_batches`, `losses.loss_weights` with its
`axis_name`) also run under `jax.pmap` (tests/training/core/test_train_step.py).

The loss is always the *global* batch loss (e.g. the token-weighted task_mean
over all rows of all devices): per-token weights come from the full batch
(`losses.loss_weights`), each device/micro-batch adds `sum(w * l)` and its
gradient, and the sums are the exact full-batch loss and gradient. So a
mesh, a single device and grad_accum=k give the same update (up to fp32
reduction order).

The loss reads the model through `objectives.apply_loss`: from dense logits,
or (losses with `from_model`) from hidden states chunk by chunk and from a
teacher run inside the step: `step(state, batch, extras, teacher=params)`
passes a frozen teacher's params (same structure as state.params; never
donated), or another model with a `place(mesh, rules)` method that puts it on
the step's mesh (`training.distill.TeacherModel`); without it a teacher is the
live params, gradient stopped.

Memory: a DecoderConfig's "auto" runtime fields (scan_layers, remat,
attention_backend) and the losses' chunk_size "auto" are the memory plan
(`models.memory_plan`); the step logs it (logger `ac2_jax.models.memory_plan`,
one INFO line: each choice and why, the estimate against the device's memory)
each time it compiles for a new batch shape, and warns when the estimate
exceeds the device's memory.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ac2_jax.losses import loss_weights
from ac2_jax.models.axes import AxisRules
from ac2_jax.models.config import DecoderConfig
from ac2_jax.models.memory_plan import log_step_plan
from ac2_jax.segments import PackedBatch
from ac2_jax.training.core.distributed import global_batch
from ac2_jax.training.core.objectives import LossFn, StepModel, apply_loss, model_logprobs
from ac2_jax.training.core.sharding import (
    BATCH_AXES,
    batch_ways,
    check_rows,
    make_mesh,
    place_batch,
    split_constraint_masks,
    state_shardings,
)
from ac2_jax.training.core.state import OptimizerConfig, TrainState, as_transform

# XLA:CPU's default scheduler orders for concurrency: at real size it computes every
# leaf's clipped gradient before any AdamW update consumes one, so a second params-sized
# set of temporaries is live at once (Qwen3-0.6B: 4.78 GB of step temporaries, 2.71 GB
# with this scheduler; docs/notes/2026-12-02-qwen3-06b-policy-on-2-cores.md). The
# memory-optimized scheduler runs each leaf's clip -> moments -> update before the next.
# Same HLO, same maths; it runs less work concurrently (measured 1.41x slower on a 4-layer
# cut of that shape, equal at toy size): `cpu_memory_scheduler=False` trades the memory back
# for speed.
CPU_MEMORY_SCHEDULER = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def forward(graphdef, params, rest, batch) -> jax.Array:
    """Logits [R, L, V] of a packed batch under (params, rest)."""
    return StepModel(graphdef, params, rest).logits(batch)


def _micro(x, k: int, constrain):
    """[R, ...] -> [k, R / k, ...]; micro-batch i takes rows i, i + k, ... so each
    device's rows split evenly (no resharding under a mesh)."""
    y = jnp.swapaxes(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 0, 1)
    return constrain(y)


def fill_micro_batches(tree, grad_accum: int, blocks: int = 1):
    """(batch, extras) with rows reordered so the rows holding loss tokens fill
    micro-batch 0 first, then 1, ...: the step skips a micro-batch without a loss
    token, so a fixed geometry bigger than the data (padding rows) costs no compute.

    `blocks`: the row blocks that split separately (pmap: one per device, each
    device runs its own micro-batches); the rows of each micro-batch are dealt
    evenly over the blocks. Host (numpy) batches only; others are returned as
    they are. Row order never changes the loss: its weights come from task and
    segment ids, and every row is its own sequence. A batch's constraint_masks
    table (not row-aligned) stays as it is.
    """
    batch, extras = tree
    batch, table = split_constraint_masks(batch)
    rows = batch.shape[0]
    if (
        grad_accum == 1
        or not isinstance(batch.loss_mask, np.ndarray)
        or rows % (grad_accum * blocks)
    ):  # a bad row count is check_rows' to name
        return tree
    has = batch.loss_mask.reshape(rows, -1).any(axis=1)
    order = np.concatenate([np.flatnonzero(has), np.flatnonzero(~has)])
    # The i-th row of `order` goes to micro-batch j = i // (rows / k), block d = i % blocks,
    # at slot r of that block's micro-batch j: position d * (rows / blocks) + r * k + j.
    i = np.arange(rows)
    per_micro, per_block = rows // grad_accum, rows // blocks
    j, rest = i // per_micro, i % per_micro
    perm = np.empty(rows, np.int64)
    perm[(rest % blocks) * per_block + (rest // blocks) * grad_accum + j] = order
    if (perm == i).all():
        return tree
    aligned = lambda x: hasattr(x, "shape") and x.ndim and x.shape[0] == rows  # noqa: E731
    batch, extras = jax.tree.map(lambda x: x[perm] if aligned(x) else x, (batch, extras))
    return (batch if table is None else batch.replace(constraint_masks=table)), extras


def loss_and_grads(
    graphdef,
    loss_fn: LossFn,
    params,
    rest,
    batch,
    extras,
    weights,
    grad_accum: int = 1,
    constrain=lambda y: y,
    teacher=None,
):
    """(sum(w * l), metric sums, grads, micro-batches skipped) over the given rows,
    in `grad_accum` pieces.

    weights [R, L] from `loss_weights` (of the full batch). teacher: frozen
    teacher params or None (see `StepModel`). Grads are accumulated in fp32
    and returned in the params' dtype. A micro-batch without a loss token adds
    nothing to the loss, its metric sums or the gradients, so it is skipped
    (`lax.cond`): padding rows put there (`fill_micro_batches`) cost no compute.
    The batch's constraint_masks table (not row-aligned) goes whole to each.
    """

    def f(p, b, e, w):
        per_token, sums = apply_loss(loss_fn, StepModel(graphdef, p, rest, teacher), b, e)
        return (w * per_token).sum(), sums

    vg = jax.value_and_grad(f, has_aux=True)
    if grad_accum == 1:
        (loss, sums), grads = vg(params, batch, extras, weights)
        return loss, sums, grads, jnp.zeros((), jnp.float32)
    batch, table = split_constraint_masks(batch)

    def whole(mb):  # a micro-batch with the batch's mask table, if any
        b, e, w = mb
        return (b if table is None else b.replace(constraint_masks=table)), e, w

    xs = jax.tree.map(lambda x: _micro(x, grad_accum, constrain), (batch, extras, weights))
    first = jax.tree.map(lambda x: x[0], xs)
    _, sums_shape = jax.eval_shape(f, params, *whole(first))
    f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)  # noqa: E731
    init = (
        jnp.zeros((), jnp.float32),
        jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), sums_shape),
        jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
    )

    def run(mb):
        (loss, sums), grads = vg(params, *whole(mb))
        return f32(loss), f32(sums), f32(grads)

    def body(carry, mb):
        has_loss = jnp.any(mb[0].loss_mask != 0)
        out = jax.lax.cond(has_loss, run, lambda _: jax.tree.map(jnp.zeros_like, init), mb)
        return jax.tree.map(jnp.add, carry, out), has_loss

    (loss, sums, grads), ran = jax.lax.scan(body, init, xs)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
    return loss, sums, grads, (~ran).sum().astype(jnp.float32)


def _counts(batch):
    m = batch.loss_mask.astype(jnp.float32)
    return {
        "tokens": (batch.segment_ids > 0).sum().astype(jnp.float32),
        "loss_tokens": (m > 0).sum().astype(jnp.float32),
        "_mask": m.sum(),
    }


class TrainStep:
    """`step(state, batch, extras=None) -> (state, metrics)`; see `make_train_step`.

    One path: the step is jitted over a mesh with shardings. Without a mesh it
    is a one-device mesh (the first local device), so one device, a data x
    fsdp x tensor mesh and many processes compile the same function.
    """

    def __init__(
        self,
        graphdef,
        loss_fn: LossFn,
        optimizer,
        *,
        mesh: Mesh | None = None,
        grad_accum: int = 1,
        lr_schedule=None,
        donate: bool = True,
        cpu_memory_scheduler: bool = True,
        xla_options: dict | None = None,
        axis_rules: AxisRules | None = None,
    ):
        if int(grad_accum) < 1:
            raise ValueError(f"make_train_step: grad_accum must be >= 1, got {grad_accum}")
        self.graphdef, self.loss_fn = graphdef, loss_fn
        self.mesh: Mesh = make_mesh(devices=jax.local_devices()[:1]) if mesh is None else mesh
        self.grad_accum, self.donate = int(grad_accum), donate
        self.tx, self.optimizer = as_transform(optimizer), optimizer
        if lr_schedule is None and isinstance(optimizer, OptimizerConfig):
            lr_schedule = optimizer.lr_schedule()
        self.lr_schedule = lr_schedule
        self.cpu_memory_scheduler = cpu_memory_scheduler
        self.xla_options = dict(xla_options or {})
        self.state_sharding: TrainState | None = None  # a TrainState of NamedShardings
        # Logical axis -> mesh axes of the params; dimensions the rules replicated
        # because they do not divide (indivisible="replicate") are listed.
        self.axis_rules = AxisRules() if axis_rules is None else axis_rules
        self.sharding_fallbacks: list = []
        self._step: Any = None
        self._logprobs: Any = None

    @property
    def devices(self) -> list:
        """The mesh's devices (one, without a mesh)."""
        return list(self.mesh.devices.flat)

    # -- the pure step

    def _log_plan(self, state: TrainState, batch) -> None:
        """Logs the memory plan for this batch shape: runs when the step is traced,
        so once per compiled shape. Models without a DecoderConfig are skipped."""
        config = getattr(
            StepModel(self.graphdef, state.params, state.rest).module(), "config", None
        )
        if isinstance(config, DecoderConfig):
            log_step_plan(
                config,
                rows=max(batch.tokens.shape[0] // self.grad_accum, 1),
                tokens=batch.tokens.shape[1],
                logprob_chunk=getattr(self.loss_fn, "chunk_size", None),
                device=self.devices[0],
            )

    def _update(self, state: TrainState, batch, extras, teacher):
        self._log_plan(state, batch)
        row = NamedSharding(
            self.mesh, P(None, tuple(a for a in BATCH_AXES if a in self.mesh.shape))
        )
        constrain = lambda y: jax.lax.with_sharding_constraint(y, row)  # noqa: E731
        weights = loss_weights(batch, self.loss_fn.mode, normalizer=self.loss_fn.normalizer)
        loss, sums, grads, skipped = loss_and_grads(
            self.graphdef,
            self.loss_fn,
            state.params,
            state.rest,
            batch,
            extras,
            weights,
            self.grad_accum,
            constrain,
            teacher,
        )
        counts = {
            **_counts(batch),
            "micro_batches_skipped": skipped,
            "batch_rows": jnp.float32(batch.shape[0]),
        }
        grad_norm = optax.global_norm(grads)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new = dataclasses.replace(  # a flax struct dataclass is a dataclass
            state,
            step=state.step + 1,
            params=params,
            opt_state=opt_state,
            rng=jax.random.split(state.rng)[0],
        )
        denom = jnp.maximum(counts.pop("_mask"), 1e-8)
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            **counts,
            **{k: v / denom for k, v in sums.items()},
        }
        if self.lr_schedule is not None:
            metrics["lr"] = jnp.asarray(self.lr_schedule(state.step), jnp.float32)
        return new, metrics

    # -- compilation

    def _shardings(self, state) -> TrainState:
        if self.state_sharding is None:
            self.sharding_fallbacks = []
            self.state_sharding = state_shardings(
                state, self.mesh, self.axis_rules, self.sharding_fallbacks
            )
        return self.state_sharding

    def _build(self, state):
        out = (self._shardings(state), NamedSharding(self.mesh, P()))
        update = self._update
        if any(d.platform == "tpu" for d in self.devices):
            update = _under_mesh(update, self.mesh)
        self._step = jax.jit(
            update,
            out_shardings=out,
            donate_argnums=(0,) if self.donate else (),
            compiler_options=self.compiler_options(),
        )

    def compiler_options(self) -> dict | None:
        """XLA options of the step: the memory-optimized scheduler on CPU
        (`CPU_MEMORY_SCHEDULER`), then `xla_options` over it; None when there
        are none."""
        cpu = all(d.platform == "cpu" for d in self.devices)
        out = dict(CPU_MEMORY_SCHEDULER) if cpu and self.cpu_memory_scheduler else {}
        out.update(self.xla_options)
        return out or None

    def place(self, state: TrainState, copy: bool = True) -> TrainState:
        """A host (or restored) state on the mesh, sharded as the step wants it.

        copy=True: always new buffers, so donating them never deletes the arrays
        of the model or state it came from (both stay alive: at real size a
        second params + AdamW state). copy=False: the step takes the state over;
        arrays already where the step wants them are reused, and the first step
        deletes them (and the model's, if the state came from
        `create_train_state(model)`): drop every other reference.
        """
        return jax.device_put(state, self._shardings(state), may_alias=not copy)

    def lower(self, state: TrainState, batch, extras: dict | None = None, teacher=None):
        """The step lowered for (state, batch, extras) without running it: e.g.
        `.compile().memory_analysis()` from an abstract state (`abstract_train_state`),
        which needs no parameter memory."""
        if self._step is None:
            self._build(state)
        batch, extras = self._place_rows(self._fill((batch, extras)))
        return self._step.lower(state, batch, extras, self._place_teacher(teacher))

    def _fill(self, tree):
        """Rows with loss tokens first in the micro-batches (`fill_micro_batches`)."""
        return fill_micro_batches(tree, self.grad_accum)

    def _place_rows(self, tree):
        many = self.mesh.is_multi_process
        if many:  # each process holds its rows: one global batch
            tree = jax.tree.map(
                lambda t: None if t is None else global_batch(t, self.mesh),
                tree,
                is_leaf=lambda t: t is None or isinstance(t, (PackedBatch, dict)),
            )
        rows = jax.tree.leaves(tree)[0].shape[0]  # a batch's first leaf: tokens
        check_rows(rows, batch_ways(self.mesh), self.grad_accum, "train step")
        return tree if many else place_batch(tree, self.mesh)

    def _place_teacher(self, teacher):
        if teacher is None:
            return None
        assert self.state_sharding is not None, "the step is built before a teacher is placed"
        if hasattr(type(teacher), "place"):  # another model (distill's TeacherModel)
            return teacher.place(self.mesh, self.axis_rules)
        return jax.device_put(teacher, self.state_sharding.params)

    def __call__(self, state: TrainState, batch, extras: dict | None = None, teacher=None):
        if self._step is None:
            self._build(state)
        batch, extras = self._place_rows(self._fill((batch, extras)))
        state = jax.device_put(state, self.state_sharding)
        return self._step(state, batch, extras, self._place_teacher(teacher))

    def logprobs(self, state: TrainState, batch) -> jax.Array:
        """Learner log-probs of batch.targets [R, L] under the batch's sampling
        parameters (`behaviour_logprobs`: e.g. PPO old log-probs), chunked like
        the loss (its `chunk_size`, if any; "auto" by the batch's shape)."""
        chunk = getattr(self.loss_fn, "chunk_size", None)

        def f(s, b):
            model = StepModel(self.graphdef, s.params, s.rest)
            return model_logprobs(model, b, behaviour=True, entropy=False, chunk_size=chunk)[0]

        if self._logprobs is None:
            self._logprobs = jax.jit(f)
        return self._logprobs(state, self._place_rows(batch))


def make_train_step(
    graphdef,
    loss_fn: LossFn,
    optimizer,
    *,
    mesh: Mesh | None = None,
    grad_accum: int = 1,
    lr_schedule=None,
    donate: bool = True,
    cpu_memory_scheduler: bool = True,
    xla_options: dict | None = None,
    axis_rules: AxisRules | None = None,
) -> TrainStep:
    """A compiled train step: `step(state, batch, extras=None) -> (state, metrics)`.

    optimizer: OptimizerConfig or optax transformation (the one the state was
    created with). loss_fn: e.g. `SFTLoss()` / `PolicyGradientLoss()`.
    mesh: a ('data', 'fsdp', 'tensor') mesh (`make_mesh`); None = one device.
    Batch rows must split into grad_accum micro-batches of a multiple of the
    data-parallel shard count. `step.place(state)` puts a fresh or restored
    state on the mesh. The input state is donated (donate=False keeps it).
    `step(state, batch, extras, teacher=params)` hands losses that run a
    teacher a frozen copy of the params (default: the live params).
    The model's memory plan (scan, remat, attention kernel, the loss's log-prob
    chunking: `models.memory_plan`) is logged when the step compiles.
    cpu_memory_scheduler: on CPU, compile with XLA's memory-optimized scheduler
    (`CPU_MEMORY_SCHEDULER`: one params-sized set of temporaries fewer at peak).
    xla_options: further XLA debug options for this step's compile only, e.g.
    {"xla_cpu_use_onednn": True} (names: `XLA_FLAGS=--help`; an unknown name or
    value fails at the first step with XLA's error).
    axis_rules: how the params' logical axes map to the mesh's axes
    (`models.axes.AxisRules`; default DEFAULT_RULES, an indivisible dimension
    is an error); `step.sharding_fallbacks` lists what indivisible="replicate"
    rules replicated.
    metrics: loss, grad_norm, tokens (non-padding), loss_tokens, lr, the
    loss's token-mean metrics (e.g. entropy, kl_to_sampler, and the bounds
    `PolicyGradientLoss.bounds()` names: clip_frac, dual_clip_frac, tis_frac),
    batch_rows (the global batch's rows) and micro_batches_skipped
    (micro-batches without a loss token, not computed).
    """
    return TrainStep(
        graphdef,
        loss_fn,
        optimizer,
        mesh=mesh,
        grad_accum=grad_accum,
        lr_schedule=lr_schedule,
        donate=donate,
        cpu_memory_scheduler=cpu_memory_scheduler,
        xla_options=xla_options,
        axis_rules=axis_rules,
    )


class StepCache:
    """A `make_train_step` that returns one TrainStep per equal configuration.

    The compiled functions live in the TrainStep (jit recompiles only for new
    shapes), so steps built through one cache compile once, e.g. across the
    seeds of an experiment or the trainers of a test module. Owned by its
    caller: no global state.
    """

    def __init__(self):
        self.steps: dict = {}

    def __call__(self, graphdef, loss_fn: LossFn, optimizer, **kwargs) -> TrainStep:
        # Every argument, defaults filled in (an omitted one equals its default),
        # lists and dicts (devices, xla_options) as tuples.
        args = inspect.signature(make_train_step).bind(graphdef, loss_fn, optimizer, **kwargs)
        args.apply_defaults()
        key = tuple((k, _hashable(v)) for k, v in args.arguments.items())
        try:
            hash(key)
        except TypeError as e:
            raise TypeError(
                f"StepCache: the configuration is not hashable ({e}); call make_train_step directly"
            ) from e
        if key not in self.steps:
            self.steps[key] = make_train_step(graphdef, loss_fn, optimizer, **kwargs)
        return self.steps[key]


def _hashable(value):
    """A list as a tuple, a dict as its sorted items; anything else as it is."""
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def _under_mesh(fn, mesh: Mesh):
    """`fn` traced with `mesh` as the abstract mesh, so the TPU kernels (attention
    "pallas_tpu", the MoE experts' gmm) run in shard_map over its batch / head axes
    instead of XLA gathering their operands to every device (a Pallas call has no
    partitioning rule of its own)."""

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced
