"""Metrics sinks: JSONL (always), TensorBoard scalar event files (`_tfevents`), a rich
console line and Weights & Biases (optional, the wandb extra)."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from ac2_jax.extras import require
from ac2_jax.training.core._tfevents import ScalarEventWriter


def _scalar(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


CONSOLE_WIDTH = 120  # characters of a console line, at most
DEFAULT_KEYS = (
    "reward_mean",
    "pass_rate",
    "loss",
    "kl_to_sampler",
    "entropy",
    "time_sampling_s",
    "time_training_s",
)


def no_signal_reason(scalars: dict[str, float], prefix: str | None = None) -> str | None:
    """Why a step trained nothing, from its metrics, or None when it trained (or its
    metrics do not say): a step with `skipped_update` set (RLTrainer: no segment
    carried an advantage) or whose `trained_tokens/<group>` are all 0."""
    p = f"{prefix}/" if prefix else ""
    tokens = [v for k, v in scalars.items() if k.startswith(f"{p}trained_tokens/")]
    skipped = scalars.get(f"{p}skipped_update")
    if not (skipped or (skipped is None and tokens and not any(tokens))):
        return None
    if scalars.get(f"{p}traces") == 0:
        return "no signal: no traces"
    if scalars.get(f"{p}zero_advantage_groups"):
        return "no signal: every group tied"
    if not tokens:
        return "no signal: no trace kept"
    return "no signal: no agent token to train"


def console_line(
    step: int,
    scalars: dict[str, float],
    keys=DEFAULT_KEYS,
    *,
    prefix: str | None = None,
    width: int = CONSOLE_WIDTH,
) -> str:
    """`step N  key=value ...` for the `keys` present (in that order), and why the
    step trained nothing when it did not (`no_signal_reason`). At most `width`
    characters: the last keys (the lowest priority) are left out first."""
    p = f"{prefix}/" if prefix else ""
    head = f"step {step}"
    reason = no_signal_reason(scalars, prefix)
    tail = [f"({reason})"] if reason else []
    shown = [f"{p}{k}={scalars[p + k]:.4g}" for k in keys if p + k in scalars]
    while shown and len("  ".join([head, *shown, *tail])) > width:
        shown.pop()
    return "  ".join([head, *shown, *tail])[:width]


class MetricsLogger:
    """`log(step, metrics, prefix=None)` appends a JSONL line and writes TensorBoard scalars.

    With a prefix ("train", "eval") every key is logged as `prefix/key`, in
    the JSONL and in TensorBoard. Non-numeric and non-finite values are left
    out of the line and counted in `dropped` (per key). The console line
    (`console_line`) shows `keys` in at most 120 characters and says why a step
    trained nothing. wandb: also log the scalars to Weights & Biases
    (`wandb.init(**wandb)` for a dict, `wandb.init()` for True; needs the wandb
    extra); `close()` finishes that run.
    """

    def __init__(
        self,
        directory: str,
        *,
        tensorboard: bool = True,
        console: bool = True,
        wandb: bool | dict[str, Any] = False,
    ):
        wandb_module = None
        if wandb:  # first: a missing package leaves nothing behind
            wandb_module = require("wandb", "wandb", what="MetricsLogger(wandb=...)")
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "metrics.jsonl")
        self._writer = None
        if tensorboard:
            self._writer = ScalarEventWriter(os.path.join(directory, "tensorboard"))
        self._console = None
        if console:
            from rich.console import Console

            self._console = Console(stderr=True)
        self._wandb = None
        if wandb_module is not None:
            self._wandb = wandb_module.init(**(wandb if isinstance(wandb, dict) else {}))
        self.dropped: dict[str, int] = {}

    def log(
        self,
        step: int,
        metrics: dict[str, Any],
        *,
        prefix: str | None = None,
        keys=DEFAULT_KEYS,
    ) -> None:
        scalars = {}
        for k, v in metrics.items():
            name = f"{prefix}/{k}" if prefix else k
            if (s := _scalar(v)) is None:
                self.dropped[name] = self.dropped.get(name, 0) + 1
            else:
                scalars[name] = s
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": int(step), "time": time.time(), **scalars}) + "\n")
        if self._writer is not None:
            for k, v in scalars.items():
                self._writer.add_scalar(k, v, int(step))
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=int(step))
        if self._console is not None:
            from rich.text import Text  # plain text: a key is never read as markup

            line = console_line(step, scalars, keys, prefix=prefix)
            text = Text(line)
            text.stylize("bold", 0, len(f"step {step}"))
            # Never wrapped by rich (the line is at most CONSOLE_WIDTH already).
            self._console.print(text, soft_wrap=True)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
