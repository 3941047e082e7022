"""Metrics sinks: JSONL (always), TensorBoard (tensorboardX) and a rich console line."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any


def _scalar(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class MetricsLogger:
    """`log(step, metrics, prefix=None)` appends a JSONL line and writes TensorBoard scalars.

    With a prefix ("train", "eval") every key is logged as `prefix/key`, in
    the JSONL and in TensorBoard. Non-numeric and non-finite values are left
    out of the line and counted in `dropped` (per key).
    """

    def __init__(self, directory: str, *, tensorboard: bool = True, console: bool = True):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "metrics.jsonl")
        self._writer = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._writer = SummaryWriter(os.path.join(directory, "tensorboard"))
        self._console = None
        if console:
            from rich.console import Console

            self._console = Console(stderr=True)
        self.dropped: dict[str, int] = {}

    def log(
        self,
        step: int,
        metrics: dict[str, Any],
        *,
        prefix: str | None = None,
        keys=(
            "reward_mean",
            "pass_rate",
            "loss",
            "kl_to_sampler",
            "entropy",
            "time_sampling_s",
            "time_training_s",
        ),
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
        if self._console is not None:
            p = f"{prefix}/" if prefix else ""
            shown = "  ".join(f"{p}{k}={scalars[p + k]:.4g}" for k in keys if p + k in scalars)
            self._console.print(f"[bold]step {step}[/bold]  {shown}")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
