"""Training curves as PNG (matplotlib, no GUI backend, no global pyplot state).

Metrics come from a JSONL file (one JSON object per line, e.g. a training
log: `{"step": 10, "train/loss": 0.7, ...}`), a list of such records, or a
dict `{name: [value, ...]}` / `{name: [[step, value], ...]}`. A record
without "step" takes its line index; a metric missing from a record, or
not a number, is skipped for that step.
"""

from __future__ import annotations

import io
import json
import math
import numbers
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from ac2_jax.extras import require

require("matplotlib", "viz", what="ac2_jax.viz.curves")

from matplotlib.figure import Figure  # noqa: E402

Series = dict[str, tuple[np.ndarray, np.ndarray]]


def _is_number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))


def _from_records(records: Sequence[dict[str, Any]]) -> Series:
    acc: dict[str, tuple[list, list]] = {}
    for i, rec in enumerate(records):
        if not isinstance(rec, dict):
            raise ValueError(f"load_metrics: record {i} is {type(rec).__name__}, not a JSON object")
        step = rec.get("step", i)
        for k, v in rec.items():
            if k != "step" and _is_number(v):
                xs, ys = acc.setdefault(k, ([], []))
                xs.append(float(step))
                ys.append(float(v))
    return {k: (np.asarray(xs), np.asarray(ys)) for k, (xs, ys) in acc.items()}


def load_metrics(source) -> Series:
    """{name: (steps [n], values [n])} from a JSONL path, records or a dict."""
    if isinstance(source, (str, pathlib.Path)):
        path = pathlib.Path(source)
        if not path.exists():
            raise FileNotFoundError(f"load_metrics: no metrics file at {path}")
        records = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"load_metrics: {path}:{n} is not JSON: {e}") from None
        return _from_records(records)
    if isinstance(source, dict):
        out = {}
        for k, vals in source.items():
            arr = np.asarray(vals, np.float64)
            if arr.ndim == 1:
                out[k] = (np.arange(arr.shape[0], dtype=np.float64), arr)
            elif arr.ndim == 2 and arr.shape[1] == 2:
                out[k] = (arr[:, 0], arr[:, 1])
            else:
                raise ValueError(
                    f"load_metrics: metric {k!r} must be [values] or [[step, value]], "
                    f"got shape {arr.shape}"
                )
        return out
    if isinstance(source, (list, tuple)):
        return _from_records(source)
    raise TypeError(
        f"load_metrics: expected a path, records or a dict, got {type(source).__name__}"
    )


def curves_figure(
    metrics,
    keys: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> Figure:
    """One subplot per metric key (default: all, sorted). Returns the Figure."""
    series = load_metrics(metrics)
    keys = sorted(series) if keys is None else list(keys)
    missing = [k for k in keys if k not in series]
    if missing:
        raise KeyError(f"plot_curves: metrics {missing} not found; available: {sorted(series)}")
    if not keys:
        raise ValueError("plot_curves: no metrics to plot")
    labels = list(keys) if labels is None else list(labels)
    if len(labels) != len(keys):
        raise ValueError(f"plot_curves: {len(labels)} labels for {len(keys)} keys")
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    fig = Figure(figsize=(4.2 * cols, 3.0 * rows), dpi=100)
    for i, (k, label) in enumerate(zip(keys, labels, strict=True)):
        ax = fig.add_subplot(rows, cols, i + 1)
        xs, ys = series[k]
        ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=k)
        ax.set_title(label if label == k else f"{label}\n({k})", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_curves(
    metrics,
    path_png: str | pathlib.Path | None = None,
    keys: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
    title: str | None = None,
) -> bytes:
    """Plots training curves to PNG; writes `path_png` if given; returns the PNG bytes."""
    buf = io.BytesIO()
    curves_figure(metrics, keys, labels, title).savefig(buf, format="png")
    data = buf.getvalue()
    if path_png is not None:
        path = pathlib.Path(path_png)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return data
