"""Train state and optimizer: a functional (graphdef, TrainState) pair.

The model is split once into a static `graphdef`, its trainable `params`
(every `nnx.Param`; only the adapters, `nnx.LoRAParam`, of a model with LoRA
adapters: `models.lora.trainable_filter`) and the `rest` of its state (a LoRA
model's frozen base weights among it). `TrainState` is a plain
pytree, so one step function compiles under `jax.jit` (with NamedSharding),
`jax.pmap` and Orbax alike; `nnx.merge(graphdef, params, rest)` rebuilds the
module inside the step.
"""

from __future__ import annotations

import dataclasses
from typing import cast

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from ac2_jax.models.layers import frozen_bits
from ac2_jax.models.lora import trainable_filter

SCHEDULES = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with global-norm clipping and a warmup + constant/cosine schedule.

    Warmup is linear and reaches `learning_rate` at step `warmup_steps` (step 0
    already trains at lr / warmup_steps, never at 0). `cosine` decays to
    `end_lr_ratio * learning_rate` at `total_steps`. Weight decay applies to
    params with ndim >= `decay_min_ndim` (matrices, not norms or biases).
    """

    learning_rate: float = 3e-4  # the peak learning rate (after warmup)
    schedule: str = "constant"  # "constant" or "cosine" after warmup
    warmup_steps: int = 0  # linear warmup steps to learning_rate
    total_steps: int | None = None  # where "cosine" reaches end_lr_ratio * learning_rate
    end_lr_ratio: float = 0.0  # the cosine schedule's final fraction of learning_rate
    b1: float = 0.9  # AdamW's first-moment decay
    b2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's denominator epsilon
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    decay_min_ndim: int = 2  # weight decay on params with at least this many dims
    clip_norm: float | None = 1.0  # global gradient-norm clip (None: none)

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(
                f"OptimizerConfig.schedule must be one of {SCHEDULES}, got {self.schedule!r}"
            )
        if self.learning_rate < 0:
            raise ValueError(
                f"OptimizerConfig.learning_rate must be >= 0, got {self.learning_rate}"
            )
        if self.warmup_steps < 0:
            raise ValueError(f"OptimizerConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule == "cosine" and (
            self.total_steps is None or self.total_steps <= self.warmup_steps
        ):
            raise ValueError(
                "OptimizerConfig: schedule='cosine' needs total_steps > "
                f"warmup_steps, got total_steps={self.total_steps}, "
                f"warmup_steps={self.warmup_steps}"
            )
        if self.clip_norm is not None and self.clip_norm <= 0:
            raise ValueError(f"OptimizerConfig.clip_norm must be > 0 or None, got {self.clip_norm}")

    def lr_schedule(self) -> optax.Schedule:
        """step (int array) -> learning rate (fp32)."""
        lr, warm = self.learning_rate, self.warmup_steps

        def schedule(step):
            step = jnp.asarray(step, jnp.float32)
            scale = jnp.minimum(1.0, (step + 1.0) / warm) if warm > 0 else jnp.float32(1.0)
            if self.schedule == "cosine":
                frac = jnp.clip((step - warm) / (self.total_steps - warm), 0.0, 1.0)
                cos = 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
                scale = scale * (self.end_lr_ratio + (1.0 - self.end_lr_ratio) * cos)
            return lr * scale

        return schedule

    def build(self) -> optax.GradientTransformation:
        """The optax transformation (clip -> AdamW). Deterministic: build it anywhere."""
        min_ndim = self.decay_min_ndim
        adamw = optax.adamw(
            self.lr_schedule(),
            b1=self.b1,
            b2=self.b2,
            eps=self.eps,
            weight_decay=self.weight_decay,
            mask=lambda params: jax.tree.map(lambda p: p.ndim >= min_ndim, params),
        )
        if self.clip_norm is None:
            return adamw
        return optax.chain(optax.clip_by_global_norm(self.clip_norm), adamw)


@struct.dataclass
class TrainState:
    """Everything a step changes: step (int32 []), params (nnx.State of Params),
    opt_state (optax), rng (uint32 [2] raw key), rest (non-Param model state)."""

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState
    rng: jax.Array
    rest: nnx.State

    def model(self, graphdef: nnx.GraphDef) -> nnx.Module:
        """The module with these params (a copy; use inside or outside jit), its frozen
        weights in their own dtype (`rest` may hold them as bits: `frozen_bits`)."""
        model = nnx.merge(graphdef, self.params, self.rest, copy=True)
        state = nnx.state(model)
        back = frozen_bits(model, state, to_bits=False)
        if back is not state:  # only a LoRA model with a 16-bit base holds bits
            nnx.update(model, back)
        return model


def as_transform(optimizer) -> optax.GradientTransformation:
    """OptimizerConfig or optax transformation -> optax transformation."""
    if isinstance(optimizer, OptimizerConfig):
        return optimizer.build()
    if isinstance(optimizer, optax.GradientTransformation):
        return optimizer
    raise TypeError(
        "optimizer must be an OptimizerConfig or an optax.GradientTransformation, "
        f"got {type(optimizer).__name__}"
    )


def create_train_state(
    model: nnx.Module, optimizer, rng: int | jax.Array = 0
) -> tuple[nnx.GraphDef, TrainState]:
    """Splits `model` and initializes the optimizer. Returns (graphdef, state).

    `rng` is an int seed or a raw uint32[2] key (typed keys are unwrapped so the
    state stays checkpointable as a plain array).
    """
    graphdef, params, *others = nnx.split(model, trainable_filter(model), ...)
    (rest,) = others  # the `...` filter: everything not trained (a LoRA model's base too)
    if not jax.tree.leaves(params):
        raise ValueError("create_train_state: the model has no nnx.Param to train")
    if isinstance(rng, int):
        rng = jax.random.PRNGKey(rng)
    elif jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    opt_state = as_transform(optimizer).init(params)
    state = TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt_state,
        rng=jnp.asarray(rng, jnp.uint32),
        rest=frozen_bits(model, rest),
    )
    return graphdef, state


def abstract_train_state(make_model, optimizer) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, state of ShapeDtypeStructs) without computing or storing any weights.

    make_model: () -> nnx.Module. The abstract state is a restore target (see
    `Checkpointer.restore`) and a source of shardings for models too big to
    initialize just to be overwritten.
    """
    abstract = nnx.eval_shape(make_model)
    graphdef, params, *others = nnx.split(abstract, trainable_filter(abstract), ...)
    (rest,) = others
    opt_state = jax.eval_shape(as_transform(optimizer).init, params)
    # Abstract leaves where the state holds arrays: the same tree, shapes and dtypes only.
    return graphdef, TrainState(
        step=cast(jax.Array, jax.ShapeDtypeStruct((), jnp.int32)),
        params=params,
        opt_state=opt_state,
        rng=cast(jax.Array, jax.ShapeDtypeStruct((2,), jnp.uint32)),
        rest=frozen_bits(abstract, rest),
    )


def num_params(params) -> int:
    """Total number of scalars in a params tree."""
    return int(sum(x.size for x in jax.tree.leaves(params)))
