"""Pinapple report: a table over seeds (markdown + JSON), curves (PNG), a distill page (HTML)."""

from __future__ import annotations

import json
import os

import numpy as np

from ac2_jax.evals.stats import mean_interval
from ac2_jax.viz import write_distill_report

def _ci(values, bounds=(-np.inf, np.inf)) -> dict:
    """Mean and 95% t-interval over seeds (clipped to `bounds`, e.g. [0, 1] for rates)."""
    e = mean_interval(values)
    return {"mean": e.mean, "low": max(e.low, bounds[0]), "high": min(e.high, bounds[1]),
            "n": e.n}


def summarize(cfg, runs, base_eval, teacher_eval) -> list[dict]:
    """One row per method: mean and 95% CI over seeds (rates clipped to [0, 1])."""
    rate = lambda vals: _ci(vals, (0.0, 1.0))  # noqa: E731
    rows = [{"method": "base (no training)", **{k: rate([base_eval[k]]) for k in METRICS},
             "steps_to_target": None, "reached": None, "kept_per_update": None},
            {"method": "teacher (base + hint)", **{k: rate([teacher_eval[k]]) for k in METRICS},
             "steps_to_target": None, "reached": None, "kept_per_update": None}]
    for method in cfg.methods:
        rs = [r for r in runs if r["method"] == method]
        hit = [r["steps_to_target"] for r in rs if r["steps_to_target"] is not None]
        kept = [np.mean([t["kept_tokens"] for t in r["train"]]) for r in rs]
        rows.append({"method": method, **{k: rate([r["final"][k] for r in rs]) for k in METRICS},
                     "steps_to_target": _ci(hit) if hit else None,
                     "reached": f"{len(hit)}/{len(rs)}", "kept_per_update": _ci(kept),
                     "time_s": _ci([r["time_s"] for r in rs])})
    return rows


METRICS = ("target", "target_exact", "target_train", "retention", "retain_food",
           "retain_sentence", "retain_other", "retain_math")


def _fmt(e, digits: int = 3) -> str:
    if e is None:
        return "-"
    if e["n"] == 1:
        return f"{e['mean']:.{digits}f}"
    return f"{e['mean']:.{digits}f} [{e['low']:.{digits}f}, {e['high']:.{digits}f}]"


def markdown_table(cfg, rows) -> str:
    head = (f"| method | steps to >= {cfg.loop.target_rate:.0%} held-out (reached) | held-out "
            "target | held-out exact | train target | retention | food | sentence | other | "
            "math | loss tokens / update |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        steps = ("-" if r["reached"] is None else
                 f"{_fmt(r['steps_to_target'], 1)} ({r['reached']})")
        lines.append("| " + " | ".join([r["method"], steps] + [
            _fmt(r.get(k)) for k in METRICS] + [_fmt(r["kept_per_update"], 1)]) + " |")
    return "\n".join(lines)


def plot_runs(cfg, runs, path) -> None:
    """Held-out target rate and retention vs step, mean over seeds per method."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 3.6), dpi=100)
    for j, key in enumerate(("target", "retention")):
        ax = fig.add_subplot(1, 2, j + 1)
        for method in cfg.methods:
            rs = [r for r in runs if r["method"] == method]
            steps = [e["step"] for e in rs[0]["evals"] if key in e]
            vals = np.array([[e[key] for e in r["evals"] if key in e] for r in rs])
            ax.plot(steps, vals.mean(0), marker=".", label=method)
            ax.fill_between(steps, vals.min(0), vals.max(0), alpha=0.15)
        name = ("held-out target rate" if key == "target" else
                f"retention (every {cfg.loop.retain_every}th item)")
        ax.set_title(f"{name}\nmean, band = min..max over {len(cfg.seeds)} seeds", fontsize=9)
        ax.set_xlabel("distillation step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def write_report(cfg, report_dir, runs, rows, meta) -> None:
    os.makedirs(report_dir, exist_ok=True)
    table = markdown_table(cfg, rows)
    with open(os.path.join(report_dir, "results.md"), "w") as f:
        f.write(f"# pinapple\n\n`{meta['command']}`\n\n"
                f"seeds {list(cfg.seeds)}; mean [95% CI] over seeds (t interval, rates "
                "clipped to [0, 1]); steps to target: over the seeds that reached it, checked "
                f"every {cfg.loop.target_every} steps. Retention: exact answers on all "
                "non-target items after the last step. Loss tokens / update: positions in the "
                f"loss per step (8 prompts).\n\n{table}\n\n"
                f"{meta['wall_s']:.0f}s wall, {meta['cpu_s']:.0f}s CPU on {meta['devices']}.\n")
    with open(os.path.join(report_dir, "results.json"), "w") as f:
        json.dump({"rows": rows, "runs": [{k: v for k, v in r.items()} for r in runs],
                   "meta": meta, "config": cfg.to_dict()}, f, indent=1, default=str)
    plot_runs(cfg, runs, os.path.join(report_dir, "curves.png"))
    ex = next((r for r in runs if r["method"] == cfg.report.example_method
               and r["example"] is not None), None)
    if ex is not None:
        metrics = [{"step": t["step"], "loss": t["loss"]} for t in ex["train"]]
        metrics += [{k: e[k] for k in ("step", "target", "retention") if k in e}
                    for e in ex["evals"]]
        write_distill_report(os.path.join(report_dir, "distill_report.html"),
                             **ex["example"], metrics=metrics,
                             info={"method": ex["method"], "seed": ex["seed"],
                                   "judge": cfg.loop.judge, "top_t": cfg.distill.top_t},
                             title="pinapple: RMSD example (first update)")
