"""Supervised fine-tuning on segments (traces or demonstrations), for warm starts.

Segments are packed once into rows of `seq_len`; each step takes `batch_rows`
rows in a per-epoch shuffled order that depends only on (seed, epoch), so
batch i is a pure function of i: the data position in a checkpoint is just
the number of batches consumed, and a resumed run sees the same batches.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from ac2_jax.segments import PackedBatch, Segment, pack_segments
from ac2_jax.training.objectives import SFTLoss
from ac2_jax.training.sharding import state_shardings
from ac2_jax.training.state import OptimizerConfig, TrainState, create_train_state
from ac2_jax.training.train_step import make_train_step


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Data and loop knobs. `mode` is the loss aggregation (task_mean default)."""

    seq_len: int = 256
    batch_rows: int = 8
    steps: int = 100
    seed: int = 0
    shuffle: bool = True
    truncate: bool = False
    layout: str = "flat"  # "tree": shared prefixes (system prompt, tools) computed once
    mode: str = "task_mean"
    grad_accum: int = 1
    save_every: int = 0

    def __post_init__(self):
        for name in ("seq_len", "batch_rows", "steps", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"SFTConfig.{name} must be >= 1, got {getattr(self, name)}")


class SFTData:
    """Random-access batches: `batch(i)` is the i-th training batch [batch_rows, seq_len]."""

    def __init__(self, segments: Sequence[Segment], seq_len: int, batch_rows: int, *,
                 seed: int = 0, shuffle: bool = True, truncate: bool = False,
                 layout: str = "flat"):
        if not any(s.num_agent_tokens for s in segments):
            raise ValueError("SFTData: no segment has a loss-mask token to train on")
        self.packed = pack_segments(segments, seq_len, truncate=truncate, layout=layout,
                                    rows_multiple=batch_rows)
        self.batch_rows, self.seed, self.shuffle = batch_rows, seed, shuffle
        self.batches_per_epoch = self.packed.shape[0] // batch_rows

    def batch(self, i: int) -> PackedBatch:
        epoch, k = divmod(int(i), self.batches_per_epoch)
        rows = self.packed.shape[0]
        order = (np.random.default_rng([self.seed, epoch]).permutation(rows) if self.shuffle
                 else np.arange(rows))
        idx = np.sort(order[k * self.batch_rows:(k + 1) * self.batch_rows])
        return jax.tree.map(lambda x: x[idx], self.packed)


@dataclasses.dataclass
class SFTResult:
    graphdef: nnx.GraphDef
    state: TrainState  # global (host_state) form
    history: list[dict[str, float]]

    def model(self) -> nnx.Module:
        return self.state.model(self.graphdef)


def run_sft(model: nnx.Module, segments: Sequence[Segment], config: SFTConfig = SFTConfig(),
            optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-3), *,
            mode: str = "jit", mesh=None, checkpointer=None,
            log: Callable[[int, dict], None] | None = None) -> SFTResult:
    """Trains `model` (its current weights are the start) for config.steps steps.

    With a `checkpointer` (ac2_jax.training.checkpoints.Checkpointer) the run
    resumes from its latest checkpoint and saves every `save_every` steps and
    at the end. Returns the final state and one metrics dict per step taken.
    """
    data = SFTData(segments, config.seq_len, config.batch_rows, seed=config.seed,
                   shuffle=config.shuffle, truncate=config.truncate, layout=config.layout)
    graphdef, state = create_train_state(model, optimizer, rng=config.seed)
    step_fn = make_train_step(graphdef, SFTLoss(mode=config.mode), optimizer, mode=mode,
                              mesh=mesh, grad_accum=config.grad_accum)
    start = 0
    if checkpointer is not None and checkpointer.latest_step() is not None:
        shardings = state_shardings(state, mesh) if mesh is not None else None
        state, position, _ = checkpointer.restore(state, shardings=shardings)
        start = int(position.get("batches", 0))
    state = step_fn.place(state)
    history = []
    for i in range(start, config.steps):
        state, metrics = step_fn(state, data.batch(i))
        row = {k: float(v) for k, v in jax.device_get(metrics).items()}
        row["step"] = i + 1
        history.append(row)
        if log is not None:
            log(i + 1, row)
        last = i + 1 == config.steps
        if checkpointer is not None and (last or (config.save_every
                                                  and (i + 1) % config.save_every == 0)):
            checkpointer.save(i + 1, step_fn.host_state(state), {"batches": i + 1})
    if checkpointer is not None:
        checkpointer.wait()
    return SFTResult(graphdef, step_fn.host_state(state), history)
