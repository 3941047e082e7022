"""One training loop for every driver (RL, SFT, self-distillation).

    trainer = Trainer(graphdef, state, SFTLoss(), opt, workdir=wd, checkpoint_every=10)
    start = trainer.restore()            # 0, or the loop step to continue from
    for i in range(start, steps):
        metrics = trainer.step(batch(i))  # update; log train/...; hooks; checkpoint on cadence
    trainer.close()

`steps_done` counts loop steps (a driver may end one without an update, see
`end_step`); `state.step` counts optimizer updates. Checkpoint n holds the
train state after n loop steps, the driver's `TrainerHooks.state_dict()`
(JSON) and `extra_state()` (a pytree, e.g. EMA teacher params), so a resumed
run takes exactly the steps an uninterrupted one would. Metrics go to
`workdir/metrics/metrics.jsonl` and TensorBoard as `train/<key>` and
`eval/<key>`.

Recompiles: every update reports `compiled_steps`, the number of distinct
batch geometries (shapes and dtypes of batch and extras) this trainer has fed
its step, i.e. the step's compiles. A count that grows after
`compile_warmup_steps` loop steps is logged as a warning: each new geometry
costs a full compile (minutes on a deep model). Keep it flat with static
capacities (`BatchConfig.rows`/`seq_len` large enough for the data).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging

from ac2_jax.training.core.checkpoints import Checkpointer, from_nested, to_nested
from ac2_jax.training.core.metrics_log import MetricsLogger
from ac2_jax.training.core.objectives import LossFn
from ac2_jax.training.core.state import TrainState
from ac2_jax.training.core.train_step import TrainStep, make_train_step

EXTRA = "driver"  # the checkpoint subtree holding `TrainerHooks.extra_state()`


class TrainerHooks(abc.ABC):
    """The plug-in contract: what a driver (RL, SFT, self-distillation) adds to the loop.

    Every driver implements it (`RLTrainer` and `SelfDistiller` are hooks, `run_sft`
    passes its own) and hands it to its `Trainer`: checkpoint state goes only
    through it, into the Trainer's checkpoint (no driver writes checkpoint files of
    its own). A driver must say what its checkpoint holds (`state_dict`) and check
    it on resume (`load_state_dict`); the array state and the step callback are
    optional. Order in a loop step: update, log, `on_step_end`, checkpoint
    (`state_dict`, `extra_state`). On `Trainer.restore`: `load_state_dict` first
    (a mismatch is named before any array loads), then `load_extra_state`.
    """

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """JSON-serialisable driver state saved with each checkpoint (data position,
        what decides the data order...); `{}` when there is none."""

    @abc.abstractmethod
    def load_state_dict(self, data: dict) -> None:
        """Restores `state_dict()` (`{}` from a checkpoint without one); raise ValueError
        naming what does not match this run."""

    def extra_state(self) -> Any:
        """A pytree of arrays saved with the checkpoint (e.g. teacher params), or None."""
        return None

    def load_extra_state(self, tree: Any) -> None:  # noqa: B027 - optional: a no-op
        """Restores `extra_state()` (same structure and placement as the current one)."""

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:  # noqa: B027 - optional
        """Called after loop step `step` (1-based) is logged, before its checkpoint."""


class _NoHooks(TrainerHooks):
    """A loop without driver state (the `Trainer` default)."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, data: dict) -> None:
        pass


class Trainer:
    """The train state, its compiled step, checkpoints, metrics and progress.

    step_fn: a TrainStep to reuse (same graphdef, loss, optimizer and mesh);
    else `make_step(graphdef, loss_fn, optimizer, mesh=, grad_accum=,
    donate=)` builds one (pass a `StepCache` to share compiled steps).
    workdir: checkpoints in `workdir/checkpoints`, metrics in
    `workdir/metrics` unless `logger` is given; None keeps nothing on disk
    (no checkpoints; logs only to `logger`). checkpoint_every: loop steps
    between checkpoints (0: only explicit `save()`). progress: a rich
    progress bar over `total_steps`. The state is placed for the step (copied, so the
    caller's arrays survive donation).
    """

    def __init__(
        self,
        graphdef,
        state: TrainState,
        loss_fn: LossFn,
        optimizer,
        *,
        workdir: str | os.PathLike | None = None,
        checkpoint_every: int = 0,
        keep_checkpoints: int | None = 3,
        hooks: TrainerHooks | None = None,
        mesh=None,
        grad_accum: int = 1,
        donate: bool = True,
        step_fn: TrainStep | None = None,
        make_step: Callable[..., TrainStep] = make_train_step,
        logger: MetricsLogger | None = None,
        tensorboard: bool = True,
        progress: bool = False,
        total_steps: int | None = None,
        compile_warmup_steps: int = 1,
    ):
        if checkpoint_every < 0:
            raise ValueError(f"Trainer: checkpoint_every must be >= 0, got {checkpoint_every}")
        if checkpoint_every and workdir is None:
            raise ValueError("Trainer: checkpoint_every needs a workdir")
        if step_fn is None:
            step_fn = make_step(
                graphdef,
                loss_fn,
                optimizer,
                mesh=mesh,
                grad_accum=grad_accum,
                donate=donate,
            )
        else:
            # mesh=None is "the step's own": a one-device mesh when it was made.
            mesh = step_fn.mesh if mesh is None else mesh
            want = (graphdef, loss_fn, optimizer, mesh, grad_accum)
            have = (
                step_fn.graphdef,
                step_fn.loss_fn,
                step_fn.optimizer,
                step_fn.mesh,
                step_fn.grad_accum,
            )
            names = ("graphdef", "loss_fn", "optimizer", "mesh", "grad_accum")
            bad = [n for n, a, b in zip(names, want, have, strict=True) if a != b]
            if bad:
                raise ValueError(f"Trainer: step_fn differs from this trainer in {bad}")
        self.graphdef, self.step_fn = graphdef, step_fn
        if hooks is not None and not isinstance(hooks, TrainerHooks):
            raise TypeError(f"Trainer: hooks must be a TrainerHooks, got {type(hooks).__name__}")
        self.hooks: TrainerHooks = hooks if hooks is not None else _NoHooks()
        self.state = step_fn.place(state)
        self.steps_done, self.checkpoint_every = 0, int(checkpoint_every)
        self.workdir = None if workdir is None else os.path.abspath(os.fspath(workdir))
        self.ckpt, self.logger = None, logger
        if self.workdir is not None:
            self.ckpt = Checkpointer(
                os.path.join(self.workdir, "checkpoints"), max_to_keep=keep_checkpoints
            )
            if logger is None:
                self.logger = MetricsLogger(
                    os.path.join(self.workdir, "metrics"), tensorboard=tensorboard, console=False
                )
        self._geometries: set = set()
        self._ahead: set = set()  # geometries compiled by `warmup` that no update used yet
        self.compile_warmup_steps = int(compile_warmup_steps)
        self._progress = self._task = None
        if progress:
            from rich.progress import Progress

            self._progress = Progress(*Progress.get_default_columns(), "{task.fields[info]}")
            self._task = self._progress.add_task("train", total=total_steps, info="")
            self._progress.start()

    # -- state

    def host_state(self) -> TrainState:
        """The global state (sharded over the mesh): for checkpoints, publishing, evals."""
        return self.state

    def model(self):
        return self.host_state().model(self.graphdef)

    # -- the loop

    @property
    def compiled_steps(self) -> int:
        """Distinct batch geometries fed to the step so far (= its compiles)."""
        return len(self._geometries)

    def _note_geometry(self, batch, extras, ahead: bool = False) -> None:
        leaves, tree = jax.tree.flatten((batch, extras))
        key = (
            tree,
            tuple((tuple(jax.numpy.shape(x)), str(jax.numpy.result_type(x))) for x in leaves),
        )
        if key in self._geometries:
            self._ahead.discard(key)  # an update used what `warmup` compiled
            return
        if self._ahead and not ahead:
            logging.warning(
                "Trainer: the batch geometry compiled ahead (warmup) is not this batch's, so "
                "that compile goes unused (now %s, static %s). Pin the geometry (e.g. "
                "BatchConfig.rows / seq_len / task_capacity / segment_capacity) or skip the "
                "warmup.",
                sorted({tuple(jax.numpy.shape(x)) for x in leaves})[:4],
                [
                    (k, getattr(batch, k))
                    for k in ("num_tasks", "num_segments")
                    if hasattr(batch, k)
                ],
            )
            self._ahead.clear()
        if ahead:
            self._ahead.add(key)
        self._geometries.add(key)
        # The first geometry is the warm-up compile (also after a restore at step k).
        if len(self._geometries) > 1 and self.steps_done >= self.compile_warmup_steps:
            shapes = sorted({tuple(jax.numpy.shape(x)) for x in leaves})
            logging.warning(
                "Trainer: loop step %d compiles the train step again (%d batch geometries "
                "so far; shapes now %s). Each new geometry is a full compile: keep batch "
                "capacities static (e.g. BatchConfig.rows / seq_len large enough).",
                self.steps_done + 1,
                len(self._geometries),
                shapes[:4],
            )

    def warmup(self, batch, extras: dict | None = None, teacher=None) -> bool:
        """Compiles the step for `batch`'s geometry without running it (nothing is
        updated or counted as a step), e.g. in a thread while the first batch is
        still being collected: the first `update` of that geometry then reuses the
        executable (JAX's compilation cache) instead of compiling. The geometry
        counts as the trainer's warm-up one (`compiled_steps`); an update of another
        geometry before one of it is warned (that compile went unused). Only a step
        on one process is compiled ahead; otherwise nothing is done and False is
        returned (the first update compiles, as without warmup). It reads the
        state: never run it while an update (which donates the state) runs."""
        if jax.process_count() > 1:
            return False
        self._note_geometry(batch, extras, ahead=True)
        self.step_fn.lower(self.state, batch, extras, teacher).compile()
        return True

    def update(self, batch, extras: dict | None = None, teacher=None) -> dict[str, float]:
        """One optimizer step; its metrics as floats (not logged: see `end_step`),
        with `compiled_steps` (see the module docstring). teacher: frozen teacher
        params for the step (see `make_train_step`)."""
        self._note_geometry(batch, extras)
        self.state, metrics = self.step_fn(self.state, batch, extras, teacher)
        out = {k: float(v) for k, v in jax.device_get(metrics).items()}
        out["compiled_steps"] = float(self.compiled_steps)
        return out

    def end_step(self, metrics: dict[str, Any]) -> int:
        """Ends a loop step (with or without an update): logs `metrics` under train/,
        calls `hooks.on_step_end`, checkpoints on the cadence. Returns steps_done."""
        self.steps_done += 1
        n = self.steps_done
        if self.logger is not None:
            self.logger.log(n, metrics, prefix="train")
        self.hooks.on_step_end(n, metrics)
        if self.checkpoint_every and n % self.checkpoint_every == 0:
            self.save()
        if self._progress is not None:
            assert self._task is not None  # set together with _progress
            loss = metrics.get("loss")
            self._progress.update(
                self._task, advance=1, info="" if loss is None else f"loss={float(loss):.4g}"
            )
        return n

    def step(self, batch, extras: dict | None = None) -> dict[str, float]:
        """`update` then `end_step`: one loop step of one optimizer update."""
        metrics = self.update(batch, extras)
        self.end_step(metrics)
        return metrics

    def log_eval(self, metrics: dict[str, Any], step: int | None = None) -> None:
        """Logs evaluation metrics under eval/ (at steps_done by default)."""
        if self.logger is not None:
            self.logger.log(self.steps_done if step is None else step, metrics, prefix="eval")

    # -- checkpoints

    def _checkpointer(self) -> Checkpointer:
        if self.ckpt is None:
            raise ValueError("Trainer: checkpoints need a workdir")
        return self.ckpt

    def save(self) -> bool:
        """Checkpoints the state after `steps_done` loop steps (async; once per step).
        Returns whether a save started."""
        ckpt = self._checkpointer()
        if ckpt.latest_step() == self.steps_done:
            return False
        state, extra = self.host_state(), self.hooks.extra_state()
        tree: Any = state if extra is None else {**to_nested(state), EXTRA: extra}
        data = {"steps_done": self.steps_done, "driver": self.hooks.state_dict()}
        return ckpt.save(self.steps_done, tree, data, force=True)

    def restore(self) -> int:
        """Loads the latest checkpoint of the workdir, if any; returns the loop step to
        continue from (0 when there is none)."""
        ckpt = self._checkpointer()
        if ckpt.latest_step() is None:
            return 0
        step = ckpt.latest_step()
        # The driver checks its JSON state first: a mismatch is named before the arrays load.
        data = ckpt.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))
        data = dict(data["data"] or {})
        self.hooks.load_state_dict(dict(data.get("driver", {})))
        target, extra = self.host_state(), self.hooks.extra_state()
        like = target if extra is None else {**to_nested(target), EXTRA: extra}
        restored, _, _ = ckpt.restore(like, step)
        state: TrainState = restored
        if extra is not None:  # {**train state as a nested dict, EXTRA: driver pytree}
            nested = dict(restored)
            self.hooks.load_extra_state(nested.pop(EXTRA))
            state = from_nested(nested, target)
        self.state = self.step_fn.place(state)
        self.steps_done = int(data["steps_done"])
        if self._progress is not None:
            assert self._task is not None  # set together with _progress
            self._progress.update(self._task, completed=self.steps_done)
        return self.steps_done

    def wait(self) -> None:
        if self.ckpt is not None:
            self.ckpt.wait()

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()
        if self.logger is not None:
            self.logger.close()
        if self._progress is not None:
            self._progress.stop()
