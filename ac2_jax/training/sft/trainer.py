"""Supervised fine-tuning on segments (traces or demonstrations), for warm starts.

Each step trains whole tasks: every epoch shuffles the tasks (by (seed,
epoch) only) and fills batches of `batch_rows` rows of `seq_len` with as many
whole tasks as fit, so a task's segments are never split across steps (each
step normalises every task it holds as the whole task). Batch i is a pure
function of i: the data position in a checkpoint is just the number of
batches consumed, and a resumed run sees the same batches. The loop is the
shared `Trainer` (checkpoints, exact resume, train/ metrics).

Nothing leaves the loss unsaid: `truncate=True` cuts a segment over seq_len
to its first seq_len tokens with `segments.fit_segments` (RL's cut-and-count),
and every step's metrics say what its batch lost (`truncated_segments`,
`truncated_agent_tokens`) and how many agent tokens sit at position 0 of a
segment, where no prediction trains them (`unpredicted_agent_tokens`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import numpy as np
from flax import nnx

from ac2_jax.segments import (
    FitCounts,
    PackedBatch,
    Segment,
    fit_segments,
    pack_segments,
    pow2_bucket,
)
from ac2_jax.segments.batch import packed_lengths
from ac2_jax.segments.packing import first_fit_decreasing
from ac2_jax.training.core.metrics_log import MetricsLogger
from ac2_jax.training.core.objectives import LossFn, SFTLoss
from ac2_jax.training.core.state import OptimizerConfig, TrainState, create_train_state
from ac2_jax.training.core.train_step import TrainStep, make_train_step
from ac2_jax.training.core.trainer import Trainer, TrainerHooks

_DEFAULT_OPTIMIZER = OptimizerConfig(learning_rate=1e-3)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Data and loop knobs. `mode` is the loss aggregation (task_mean default).

    checkpoint_every: steps between checkpoints when run with a workdir (0:
    only at the end); keep_checkpoints: newest kept (None: all).
    """

    seq_len: int = 256  # tokens per row; a longer demo is an error unless truncate
    batch_rows: int = 8  # rows per batch (demos packed into them)
    steps: int = 100  # optimizer steps
    seed: int = 0  # the data order's seed
    shuffle: bool = True  # reshuffle the demos each epoch
    truncate: bool = False  # cut a demo over seq_len to its first seq_len tokens (counted)
    layout: str = "flat"  # "tree": shared prefixes (system prompt, tools) computed once
    mode: str = "task_mean"  # the loss aggregation over tokens (losses.aggregation)
    # log-probs chunk_size positions at a time (None: dense; "auto": by the batch's shape)
    chunk_size: int | str | None = "auto"
    grad_accum: int = 1  # micro-batches per step (batch_rows / grad_accum rows each)
    checkpoint_every: int = 0
    keep_checkpoints: int | None = 3

    def __post_init__(self):
        for name in ("seq_len", "batch_rows", "steps", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"SFTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise ValueError(
                f"SFTConfig.checkpoint_every must be >= 0, got {self.checkpoint_every}"
            )
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ValueError(
                f"SFTConfig.keep_checkpoints must be >= 1 or None, got {self.keep_checkpoints}"
            )


class SFTData:
    """Random-access batches: `batch(i)` is the i-th training batch [batch_rows, seq_len];
    `counts(i)` what its segments lost to the cut and to position 0 (`FitCounts`)."""

    def __init__(
        self,
        segments: Sequence[Segment],
        seq_len: int,
        batch_rows: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        truncate: bool = False,
        layout: str = "flat",
    ):
        if not any(np.any(np.asarray(s.loss_mask)[1:] > 0) for s in segments):
            at_0 = sum(1 for s in segments if len(s) and s.loss_mask[0] > 0)
            raise ValueError(
                "SFTData: no segment has a loss-mask token to train on"
                + (
                    f" ({at_0} have one only at position 0, which no prediction trains: "
                    "nothing precedes a segment's first token; start each segment with "
                    "its prompt)"
                    if at_0
                    else ""
                )
            )
        self.seq_len, self.batch_rows = seq_len, batch_rows
        self.seed, self.shuffle, self.truncate, self.layout = seed, shuffle, truncate, layout
        lengths = packed_lengths(segments, seq_len, truncate, "SFTData")
        # Cut (truncate=True: nothing over seq_len is left after packed_lengths) and
        # count, per segment, so each batch reports what its own segments lost.
        self.segments: list[Segment] = []
        self._counts: list[FitCounts] = []
        for s in segments:
            fitted, counts = fit_segments([s], seq_len)
            self.segments.extend(fitted)
            self._counts.append(counts)
        by_task: dict[str, list[int]] = {}
        for i, s in enumerate(self.segments):
            by_task.setdefault(s.task, []).append(i)
        self.tasks = [by_task[t] for t in sorted(by_task)]
        self._lengths = lengths
        for t in self.tasks:
            if not self._fits(t):
                raise ValueError(
                    f"SFTData: task {self.segments[t[0]].task!r} needs more than "
                    f"batch_rows={batch_rows} rows of {seq_len} tokens; raise "
                    "batch_rows or seq_len"
                )
        self._epochs: list[list[list[int]]] = []  # per epoch: batches of segment indices
        # Static capacities from a bound over every possible batch (not each batch's own
        # counts, which would change the compiled step from batch to batch).
        self.segment_capacity = pow2_bucket(self._most_that_fit(lengths))
        self.task_capacity = pow2_bucket(
            self._most_that_fit([sum(lengths[i] for i in t) for t in self.tasks])
        )

    def _most_that_fit(self, sizes: list[int]) -> int:
        """Most items (of these token sizes) one batch can hold: the shortest first,
        until batch_rows x seq_len tokens are full (a tree shares prefixes: no bound)."""
        if self.layout == "tree":
            return len(sizes)
        room, n = self.batch_rows * self.seq_len, 0
        for size in sorted(sizes):
            if size > room:
                break
            room, n = room - size, n + 1
        return max(n, 1)

    def _fits(self, members: list[int]) -> bool:
        """Whether these segments pack into batch_rows rows (in this layout)."""
        if self.layout == "tree":  # shared prefixes take less room than their flat lengths
            rows = pack_segments(
                [self.segments[i] for i in members],
                self.seq_len,
                truncate=self.truncate,
                layout="tree",
            ).shape[0]
        else:
            rows = len(first_fit_decreasing([self._lengths[i] for i in members], self.seq_len))
        return rows <= self.batch_rows

    def _plan(self, epoch: int) -> list[list[int]]:
        """The batches of `epoch`: consecutive runs of its task order, each as long as fits
        (found by doubling then bisection, so a batch costs O(log n) packings)."""
        while len(self._epochs) <= epoch:
            e = len(self._epochs)
            order = (
                np.random.default_rng([self.seed, e]).permutation(len(self.tasks))
                if self.shuffle
                else np.arange(len(self.tasks))
            )
            take = lambda a, b, order=order: [i for t in order[a:b] for i in self.tasks[t]]  # noqa: E731
            batches, a, n = [], 0, len(order)
            while a < n:
                lo, step = a + 1, 1  # tasks[a:lo] fits (every task fits alone)
                while lo + step <= n and self._fits(take(a, lo + step)):
                    lo, step = lo + step, step * 2
                hi = min(lo + step, n + 1)  # tasks[a:hi] does not fit (or hi = n + 1)
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if self._fits(take(a, mid)) else (lo, mid)
                batches.append(take(a, lo))
                a = lo
            self._epochs.append(batches)
        return self._epochs[epoch]

    @property
    def batches_per_epoch(self) -> int:
        return len(self._plan(0))

    def _members(self, i: int) -> list[int]:
        epoch, k = 0, int(i)
        while k >= len(self._plan(epoch)):
            k -= len(self._plan(epoch))
            epoch += 1
        return sorted(self._plan(epoch)[k])

    def counts(self, i: int) -> FitCounts:
        """What batch i's segments lost: cut by truncate=True, or agent tokens at
        position 0 of a segment (no prediction trains them)."""
        return sum((self._counts[j] for j in self._members(i)), FitCounts())

    def batch(self, i: int) -> PackedBatch:
        members = self._members(i)
        return pack_segments(
            [self.segments[j] for j in members],
            self.seq_len,
            truncate=self.truncate,
            layout=self.layout,
            min_rows=self.batch_rows,
            min_tasks=self.task_capacity,
            min_segments=self.segment_capacity,
        )


@dataclasses.dataclass
class SFTResult:
    graphdef: nnx.GraphDef
    state: TrainState  # global (host_state) form
    history: list[dict[str, float]]

    def model(self) -> nnx.Module:
        return self.state.model(self.graphdef)


# What decides batch i: a checkpoint of another data order must not be resumed.
_DATA_KEYS = ("seq_len", "batch_rows", "seed", "shuffle", "truncate", "layout")


class _SFTHooks(TrainerHooks):
    def __init__(self, config: SFTConfig, num_segments: int, log):
        self.data = {k: getattr(config, k) for k in _DATA_KEYS}
        self.data["segments"] = num_segments
        self.log = log

    def state_dict(self) -> dict:
        return dict(self.data)  # the position itself is the trainer's steps_done

    def load_state_dict(self, data: dict) -> None:
        bad = {k: (data.get(k), v) for k, v in self.data.items() if data.get(k) != v}
        if bad:
            raise ValueError(
                "run_sft: the checkpoint's data order differs from this run: "
                + ", ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in bad.items())
            )

    def on_step_end(self, step: int, metrics: dict) -> None:
        if self.log is not None:
            self.log(step, {**metrics, "step": step})


def run_sft(
    model: nnx.Module,
    segments: Sequence[Segment],
    config: SFTConfig = SFTConfig(),
    optimizer: OptimizerConfig = _DEFAULT_OPTIMIZER,
    *,
    mesh=None,
    workdir: str | os.PathLike | None = None,
    log: Callable[[int, dict], None] | None = None,
    logger: MetricsLogger | None = None,
    progress: bool = False,
    make_step: Callable[..., TrainStep] = make_train_step,
) -> SFTResult:
    """Trains `model` (its current weights are the start) for config.steps steps.

    With a `workdir` the run resumes from its latest checkpoint
    (`workdir/checkpoints`), saves every `config.checkpoint_every` steps and at
    the end, and logs `train/...` metrics to `workdir/metrics`. logger: where
    the `train/...` metrics go instead (with or without a workdir; e.g. the
    run's own TensorBoard); it stays open, for the caller to close. log(step,
    metrics) is called after every step. Returns the final state and one
    metrics dict per step taken (with "step", 1-based); each has the step's
    `FitCounts` (`SFTData.counts`): truncated_segments, truncated_agent_tokens,
    unpredicted_agent_tokens.
    """
    if config.checkpoint_every and workdir is None:
        raise ValueError(
            f"run_sft: SFTConfig.checkpoint_every={config.checkpoint_every} needs a workdir"
        )
    data = SFTData(
        segments,
        config.seq_len,
        config.batch_rows,
        seed=config.seed,
        shuffle=config.shuffle,
        truncate=config.truncate,
        layout=config.layout,
    )
    graphdef, state = create_train_state(model, optimizer, rng=config.seed)
    loss: LossFn = SFTLoss(mode=config.mode, chunk_size=config.chunk_size)
    trainer = Trainer(
        graphdef,
        state,
        loss,
        optimizer,
        workdir=workdir,
        checkpoint_every=config.checkpoint_every,
        keep_checkpoints=config.keep_checkpoints,
        hooks=_SFTHooks(config, len(data.segments), log),
        mesh=mesh,
        grad_accum=config.grad_accum,
        make_step=make_step,
        logger=logger,
        progress=progress,
        total_steps=config.steps,
    )
    try:
        start = trainer.restore() if workdir is not None else 0
        history = []
        for i in range(start, config.steps):
            metrics = trainer.update(data.batch(i))
            metrics.update({k: float(v) for k, v in dataclasses.asdict(data.counts(i)).items()})
            trainer.end_step(metrics)
            history.append({**metrics, "step": i + 1})
        if workdir is not None:
            trainer.save()  # the final state (a no-op if the cadence just saved it)
        trainer.wait()
        return SFTResult(graphdef, trainer.host_state(), history)
    finally:
        if logger is not None:
            trainer.logger = None  # the caller's: not closed with the trainer
        trainer.close()
