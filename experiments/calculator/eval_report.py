"""Report of experiments/calculator/evaluate.py: PNG plots (matplotlib), an HTML page (plain,
escaped) and a rich table, all from `EvalResult`s of the same tasks."""

from __future__ import annotations

import io
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from ac2_jax.evals import Comparison, Estimate, EvalResult
from ac2_jax.viz import esc, page

CSS = "table.kv th{border:1px solid #ccc;padding:2px 8px;font-size:.85em;background:#f4f4f4}"


def fmt(e: Estimate | None, digits: int = 3) -> str:
    """"mean [low, high]" or "-" (nothing scored); an unbounded end shows as inf."""
    if e is None:
        return "-"
    return f"{e.mean:.{digits}f} [{e.low:.{digits}f}, {e.high:.{digits}f}]"


def _scopes(summary: dict) -> list[tuple[str, dict]]:
    return [("overall", summary["overall"])] + list(summary["per_domain"].items())


def _save(fig: Figure, path: str) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    with open(path, "wb") as f:
        f.write(buf.getvalue())


def _err(estimates: Sequence[Estimate | None]):
    mean = np.array([e.mean if e else np.nan for e in estimates])
    low = np.array([e.low if e else np.nan for e in estimates])
    high = np.array([e.high if e else np.nan for e in estimates])
    return mean, np.stack([mean - low, high - mean])


def plot_pass_rates(results: Sequence[EvalResult], path: str) -> None:
    """Pass rate with its interval, per scope (overall, domains) x checkpoint."""
    summaries = [r.summary() for r in results]
    scopes = [s for s, _ in _scopes(summaries[0])]
    fig = Figure(figsize=(max(5, 1.6 * len(scopes) * max(1, len(results)) / 2), 4))
    ax = fig.subplots()
    width = 0.8 / len(results)
    x = np.arange(len(scopes))
    for i, (r, s) in enumerate(zip(results, summaries)):
        scope = dict(_scopes(s))
        mean, err = _err([scope[name]["pass_rate"] for name in scopes])
        ax.bar(x + i * width, mean, width, yerr=err, capsize=3, label=r.name)
    ax.set_xticks(x + width * (len(results) - 1) / 2, scopes)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel(f"pass rate ({results[0].level:.0%} CI)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def plot_cost_and_tokens(result: EvalResult, path: str) -> None:
    """Per task (all its attempts): tokens by tier, and cost by tier."""
    per_task = result.summary()["per_task"]
    ids = list(per_task)
    fig = Figure(figsize=(max(6, 0.25 * len(ids)), 6))
    ax_tok, ax_cost = fig.subplots(2, 1, sharex=True)
    x = np.arange(len(ids))
    bottom_t, bottom_c = np.zeros(len(ids)), np.zeros(len(ids))
    tiers = (("cached_tokens", "cached_input", "cached prompt"),
             ("uncached_tokens", "uncached_input", "uncached prompt"),
             ("output_tokens", "output", "output"))
    for tok_key, cost_key, label in tiers:
        t = np.array([per_task[i]["tokens"][tok_key] for i in ids], float)
        ax_tok.bar(x, t, bottom=bottom_t, label=label)
        bottom_t += t
        if result.prices is not None:
            c = np.array([float(getattr(per_task[i]["cost"], cost_key)) for i in ids])
            ax_cost.bar(x, c, bottom=bottom_c, label=label)
            bottom_c += c
    ax_tok.set_ylabel("tokens")
    ax_tok.legend(fontsize=8)
    ax_tok.set_title(f"{result.name}: per task, {result.k} attempt(s) each")
    ax_cost.set_ylabel("USD" if result.prices is not None else "USD (no prices)")
    ax_cost.set_xticks(x, ids, rotation=90, fontsize=6)
    fig.tight_layout()
    _save(fig, path)


def plot_pass_rate_curve(results: Sequence[EvalResult], path: str) -> None:
    """Pass rate (with interval band) over checkpoints, per scope."""
    summaries = [r.summary() for r in results]
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    x = np.arange(len(results))
    for name, _ in _scopes(summaries[0]):
        ests = [dict(_scopes(s))[name]["pass_rate"] for s in summaries]
        mean, err = _err(ests)
        ax.plot(x, mean, marker="o", label=name)
        ax.fill_between(x, mean - err[0], mean + err[1], alpha=0.2)
    ax.set_xticks(x, [r.name for r in results], rotation=20, fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel(f"pass rate ({results[0].level:.0%} CI)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def write_plots(results: Sequence[EvalResult], workdir: str) -> dict[str, str]:
    """Writes the PNGs into workdir; returns {title: file name}."""
    plots = {"Pass rate by domain": "pass_rate_by_domain.png",
             f"Tokens and cost per task ({results[-1].name})": "cost_tokens_by_task.png"}
    plot_pass_rates(results, os.path.join(workdir, plots["Pass rate by domain"]))
    plot_cost_and_tokens(results[-1], os.path.join(workdir, "cost_tokens_by_task.png"))
    if len(results) > 1:
        plots["Pass rate over checkpoints"] = "pass_rate_over_checkpoints.png"
        plot_pass_rate_curve(results, os.path.join(workdir, "pass_rate_over_checkpoints.png"))
    return plots


def summary_rows(result: EvalResult) -> list[dict[str, str]]:
    """One row of display strings per scope (overall, then each domain)."""
    rows = []
    for name, s in _scopes(result.summary()):
        p, pre = s["process"], s["prefix"].to_dict()
        share = pre["reusable_share"]
        rows.append({
            "scope": name, "tasks": str(s["tasks"]), "attempts": str(s["attempts"]),
            "pass rate": fmt(s["pass_rate"]),
            "method": s["pass_rate"].method if s["pass_rate"] else "-",
            "mean reward": fmt(s["mean_reward"]),
            **{f"pass@{k}": fmt(e) for k, e in s["pass_at_k"].items()},
            **{f"pass^{k}": fmt(e) for k, e in s["pass_hat_k"].items()},
            "failures": ", ".join(f"{k} {v}" for k, v in s["failures"].items() if v) or "-",
            "excluded infra errors": str(s["excluded_infra_errors"]),
            "steps": fmt(p["steps"], 2), "tool calls": fmt(p["tool_calls"], 2),
            "tool errors": fmt(p["tool_errors"], 2),
            "cached prompt tok": fmt(p["cached_tokens"], 1),
            "uncached prompt tok": fmt(p["uncached_tokens"], 1),
            "output tok": fmt(p["output_tokens"], 1), "wall s": fmt(p["wall_time_s"], 2),
            "reusable prefix share": "-" if share is None else f"{share:.3f}",
            "cost USD": "-" if s["cost"] is None else f"{float(s['cost'].total):.6f}",
        })
    return rows


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p>(none)</p>"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{esc(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{esc(r.get(c, ''))}</td>" for c in cols) + "</tr>"
                   for r in rows)
    return f'<table class="kv"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def write_html(report: dict, results: Sequence[EvalResult],
               comparisons: Sequence[tuple[str, str, Comparison]], plots: dict[str, str],
               path: str, max_task_rows: int = 100) -> None:
    """report.html: summaries per checkpoint, comparisons (after, before, Comparison),
    plots, per-task rows of the last checkpoint."""
    parts = ["<h1>Evaluation report</h1>",
             f"<p>{esc(len(results))} checkpoint(s), {esc(len(results[0].task_ids))} tasks x "
             f"{esc(results[0].k)} attempts, {esc(f'{results[0].level:.0%}')} intervals.</p>"]
    for ckpt, r in zip(report["checkpoints"], results):
        parts.append(f"<h2>{esc(r.name)}</h2><p>{esc(ckpt.get('path') or 'initialized model')}"
                     f" (served as policy version {esc(ckpt.get('policy_version'))})</p>")
        parts.append(_table(summary_rows(r)))
    parts.append("<h2>Paired comparisons (pass, per task, after - before)</h2>")
    parts.append(_table([{"after": after, "before": before, "difference": fmt(c.estimate),
                          "method": c.estimate.method,
                          "excludes 0": str(c.estimate.excludes_zero()),
                          "tasks paired": str(c.tasks_paired),
                          "tasks dropped": str(len(c.tasks_dropped))}
                         for after, before, c in comparisons]))
    for title, name in plots.items():
        parts.append(f'<h2>{esc(title)}</h2><img src="{esc(name)}" alt="{esc(title)}">')
    last = results[-1]
    per_task = last.summary()["per_task"]
    rows = [{"task": t, "domain": v["domain"], "passes": f"{v['passes']}/{v['scored_attempts']}",
             "failures": json.dumps({k: n for k, n in v["failures"].items() if n}),
             "pass@k": json.dumps(v["pass_at_k"]),
             "tokens": json.dumps(v["tokens"]),
             "cost USD": "-" if v["cost"] is None else f"{float(v['cost'].total):.6f}"}
            for t, v in list(per_task.items())[:max_task_rows]]
    parts.append(f"<h2>Tasks ({esc(last.name)})</h2>" + _table(rows))
    if len(per_task) > max_task_rows:
        parts.append(f"<p>{esc(len(per_task) - max_task_rows)} more tasks in report.json "
                     "(report.max_task_rows).</p>")
    with open(path, "w", encoding="utf-8") as f:
        f.write(page("Evaluation report", "".join(parts), css=CSS))


def print_table(results: Sequence[EvalResult], console=None) -> None:
    """A rich table: one row per checkpoint and scope."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"evals ({results[0].level:.0%} intervals)")
    cols = ["checkpoint", "scope", "pass rate", "method", f"pass@{results[0].k}",
            f"pass^{results[0].k}", "failures", "output tok", "cost USD"]
    for c in cols:
        table.add_column(c)
    for r in results:
        for row in summary_rows(r):
            table.add_row(r.name, *(row.get(c, "-") for c in cols[1:]))
    (console or Console()).print(table)
