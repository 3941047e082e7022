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
    """`log(step, metrics)` appends a JSONL line and writes TensorBoard scalars."""

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

    def log(self, step: int, metrics: dict[str, Any], *, keys=("reward_mean", "pass_rate",
            "loss", "kl_to_sampler", "entropy", "time_sampling_s", "time_training_s")) -> None:
        scalars = {k: s for k, v in metrics.items() if (s := _scalar(v)) is not None}
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": int(step), "time": time.time(), **scalars}) + "\n")
        if self._writer is not None:
            for k, v in scalars.items():
                self._writer.add_scalar(k, v, int(step))
            self._writer.flush()
        if self._console is not None:
            shown = "  ".join(f"{k}={scalars[k]:.4g}" for k in keys if k in scalars)
            self._console.print(f"[bold]step {step}[/bold]  {shown}")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def read_metrics(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
