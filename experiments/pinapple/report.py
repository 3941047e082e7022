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
    """One row per method: mean and 95% CI over runs (seeds x data seeds; rates clipped
    to [0, 1]). base_eval / teacher_eval: the base's evals, one dict or one per data seed."""
    rate = lambda vals: _ci(vals, (0.0, 1.0))  # noqa: E731
    base = [base_eval] if isinstance(base_eval, dict) else list(base_eval)
    teacher = [teacher_eval] if isinstance(teacher_eval, dict) else list(teacher_eval)
    rows = [{"method": "base (no training)", **{k: rate([e[k] for e in base]) for k in METRICS},
             "steps_to_target": None, "reached": None, "kept_per_update": None},
            {"method": "teacher (base + hint)",
             **{k: rate([e[k] for e in teacher]) for k in METRICS},
             "steps_to_target": None, "reached": None, "kept_per_update": None}]
    for method in cfg.methods:
        rs = [r for r in runs if r["method"] == method and r.get("setting") is None]
        hit = [r["steps_to_target"] for r in rs if r["steps_to_target"] is not None]
        kept = [np.mean([t["kept_tokens"] for t in r["train"]]) for r in rs]
        rows.append({"method": method, **{k: rate([r["final"][k] for r in rs]) for k in METRICS},
                     "steps_to_target": _ci(hit) if hit else None,
                     "reached": f"{len(hit)}/{len(rs)}", "kept_per_update": _ci(kept),
                     "time_s": _ci([r["time_s"] for r in rs])})
    return rows


def claims(cfg, runs, n_boot: int = 10000, seed: int = 0) -> dict:
    """The design's two claims, scored as fixed before the faithful runs (docs/notes/
    2026-12-06-rmsd-vs-opsd-faithful-analysis-judge-try4.md), on the main runs paired by (seed, data seed):

    - half_steps: mean steps to the held-out target, RMSD / OPSD, with a 95% percentile
      bootstrap CI over the pairs (a run that never reached the target counts as
      `loop.steps + loop.target_every`, and the censored runs are counted). "about half"
      when the CI's high end is below 0.75; "fewer steps" when below 1; else "not shown".
    - retention: final retention, RMSD - SFT, mean and 95% t-interval over the pairs.
      "better" when the low end is above 0; "worse" when the high end is below 0; else
      "not shown".
    """
    censor = cfg.loop.steps + cfg.loop.target_every
    by = {}
    for r in runs:
        if r.get("setting") is None:
            by.setdefault(r["method"], {})[(r["seed"], r.get("data_seed"))] = r
    out = {}
    need = {"half_steps": ("rmsd", "opsd"), "retention": ("rmsd", "sft")}
    for name, (a, b) in need.items():
        keys = sorted(set(by.get(a, {})) & set(by.get(b, {})), key=str)
        if len(keys) < 2:
            out[name] = None
            continue
        if name == "half_steps":
            st = {m: np.array([by[m][k]["steps_to_target"] or censor for k in keys], float)
                  for m in (a, b)}
            rng = np.random.default_rng(seed)
            idx = rng.integers(0, len(keys), size=(n_boot, len(keys)))
            boot = st[a][idx].mean(1) / st[b][idx].mean(1)
            low, high = (float(x) for x in np.percentile(boot, [2.5, 97.5]))
            verdict = "about half" if high < 0.75 else "fewer steps" if high < 1 else "not shown"
            out[name] = {"ratio": float(st[a].mean() / st[b].mean()), "low": low, "high": high,
                         "pairs": len(keys), "verdict": verdict,
                         "censored": {m: int(sum(by[m][k]["steps_to_target"] is None
                                                 for k in keys)) for m in (a, b)}}
        else:
            d = [by[a][k]["final"]["retention"] - by[b][k]["final"]["retention"] for k in keys]
            e = _ci(d)
            verdict = "better" if e["low"] > 0 else "worse" if e["high"] < 0 else "not shown"
            out[name] = {**e, "pairs": len(keys), "verdict": verdict}
    return out


METRICS = ("target", "target_exact", "target_train", "retention", "retain_food",
           "retain_sentence", "retain_other", "retain_math")


def _fmt(e, digits: int = 3) -> str:
    if e is None:
        return "-"
    if e["n"] == 1:
        return f"{e['mean']:.{digits}f}"
    return f"{e['mean']:.{digits}f} [{e['low']:.{digits}f}, {e['high']:.{digits}f}]"


def _md(head: list[str], body: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(r) + " |" for r in body])


def table_cells(cfg, rows) -> tuple[list[str], list[list[str]]]:
    """The methods table as (header, rows of cells): markdown and HTML both render it."""
    head = ["method", f"steps to >= {cfg.loop.target_rate:.0%} held-out (reached)",
            "held-out target", "held-out exact", "train target", "retention", "food",
            "sentence", "other", "math", "loss tokens / update", "wall s / run"]
    body = []
    for r in rows:
        steps = ("-" if r["reached"] is None else
                 f"{_fmt(r['steps_to_target'], 1)} ({r['reached']})")
        body.append([r["method"], steps] + [_fmt(r.get(k)) for k in METRICS]
                    + [_fmt(r["kept_per_update"], 1), _fmt(r.get("time_s"), 0)])
    return head, body


def markdown_table(cfg, rows) -> str:
    return _md(*table_cells(cfg, rows))


def plot_runs(cfg, runs, path) -> None:
    """Held-out target rate and retention vs step, mean over seeds (and data seeds), one
    line per method of the main runs and per sweep setting."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 3.6), dpi=100)
    lines: dict[str, list] = {}
    for r in runs:
        st = r.get("setting")
        label = r["method"] if st is None else (
            f"rmsd {st['judge']} T={st['top_t']} S={st['top_s']} "
            f"{st.get('kind', cfg.distill.kind)}")
        lines.setdefault(label, []).append(r)
    for j, key in enumerate(("target", "retention")):
        ax = fig.add_subplot(1, 2, j + 1)
        for label, rs in lines.items():
            steps = [e["step"] for e in rs[0]["evals"] if key in e]
            vals = np.array([[e[key] for e in r["evals"] if key in e] for r in rs])
            ax.plot(steps, vals.mean(0), marker=".", label=f"{label} ({len(rs)})")
            ax.fill_between(steps, vals.min(0), vals.max(0), alpha=0.15)
        name = ("held-out target rate" if key == "target" else
                f"retention (every {cfg.loop.retain_every}th item)")
        ax.set_title(f"{name}\nmean, band = min..max over each line's runs (in brackets)",
                     fontsize=9)
        ax.set_xlabel("distillation step")
        ax.grid(alpha=0.3)
        if lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def _setting_key(setting: dict) -> tuple:
    return (setting["judge"], str(setting["top_s"]), setting["top_t"], setting.get("kind"))


def summarize_sweep(cfg, runs) -> list[dict]:
    """One row per sweep setting (RMSD's T, S, judge, kind): steps to target, final held-out
    target and retention, loss tokens per update (mean and 95% CI over seeds), and the
    judge's selections per example."""
    rows = []
    groups: dict[tuple, list] = {}
    for r in runs:
        if r.get("setting") is not None:
            groups.setdefault(_setting_key(r["setting"]), []).append(r)
    for rs in groups.values():
        hit = [r["steps_to_target"] for r in rs if r["steps_to_target"] is not None]
        stats = [r["judge_stats"] for r in rs if r.get("judge_stats")]
        examples = sum(s["examples"] for s in stats)
        rows.append({**rs[0]["setting"],
                     "steps_to_target": _ci(hit) if hit else None,
                     "reached": f"{len(hit)}/{len(rs)}",
                     "target": _ci([r["final"]["target"] for r in rs], (0.0, 1.0)),
                     "retention": _ci([r["final"]["retention"] for r in rs], (0.0, 1.0)),
                     "kept_per_update": _ci([np.mean([t["kept_tokens"] for t in r["train"]])
                                             for r in rs]),
                     "selected_per_example": (sum(s["selected"] for s in stats) / examples
                                              if examples else None)})
    return rows


def sweep_cells(cfg, rows) -> tuple[list[str], list[list[str]]]:
    """The sweep table as (header, rows of cells)."""
    head = ["judge", "S", "T", "divergence",
            f"steps to >= {cfg.loop.target_rate:.0%} held-out (reached)",
            "held-out target", "retention", "loss tokens / update", "judge picks / response"]
    body = []
    for r in rows:
        sel = "-" if r["selected_per_example"] is None else f"{r['selected_per_example']:.2f}"
        body.append([str(r["judge"]), str(r["top_s"]), str(r["top_t"]),
                     str(r.get("kind", cfg.distill.kind)),
                     f"{_fmt(r['steps_to_target'], 1)} ({r['reached']})", _fmt(r["target"]),
                     _fmt(r["retention"]), _fmt(r["kept_per_update"], 1), sel])
    return head, body


def sweep_markdown(cfg, rows) -> str:
    return _md(*sweep_cells(cfg, rows))


def plot_sweep(cfg, rows, path) -> None:
    """Steps to target, final held-out target and final retention against T, one line per
    (judge, S, divergence when several are swept), one colour per line in every panel;
    error bars are the 95% CIs over seeds (settings that never reached the target are left
    out of the first panel)."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(14, 3.8), dpi=100)
    lines: dict[tuple, list] = {}
    kinds = {r.get("kind") for r in rows}
    for r in rows:
        lines.setdefault((r["judge"], str(r["top_s"]),
                          r.get("kind") if len(kinds) > 1 else None), []).append(r)
    colours = {key: f"C{i % 10}" for i, key in enumerate(lines)}
    titles = {"steps_to_target": "steps to the held-out target",
              "target": "held-out target after the last step",
              "retention": "retention after the last step"}
    for j, key in enumerate(titles):
        ax = fig.add_subplot(1, 3, j + 1)
        for (judge, s, kind), rs in lines.items():
            rs = sorted((r for r in rs if r[key] is not None), key=lambda r: r["top_t"] or 0)
            if not rs:
                continue
            x = [r["top_t"] for r in rs]
            y = np.array([r[key]["mean"] for r in rs])
            err = np.array([[r[key]["mean"] - r[key]["low"] for r in rs],
                            [r[key]["high"] - r[key]["mean"] for r in rs]])
            err = np.where(np.isfinite(err), err, 0.0)  # one seed: no interval, no bar
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3,
                        color=colours[(judge, s, kind)],
                        label=f"{judge}, S={s}" + (f", {kind}" if kind else ""))
        ax.set_xlabel("T (divergence candidates per response)")
        ax.set_title(titles[key] + "\nmean, 95% CI over seeds", fontsize=9)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # none when no setting reached the target
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def _html_table(head: list[str], body: list[list[str]]) -> str:
    from ac2_jax.viz import esc
    th = "".join(f"<th>{esc(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in r) + "</tr>" for r in body)
    return f'<table class="results"><tr>{th}</tr>{trs}</table>'


def _png(path: str) -> str:
    import base64

    from ac2_jax.viz import esc
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode("ascii")
    name = esc(os.path.basename(path))
    return f'<img class="curves" alt="{name}" src="data:image/png;base64,{data}">'


def html_report(cfg, report_dir, runs, rows, meta) -> str:
    """The report as one standalone HTML page (the viewer's style): the run's facts, the
    table, the curves, the sweep's table and plot, and each RMSD setting's first update
    as a divergence heatmap with the judge's selections. Needs the PNGs `write_report`
    writes first."""
    from ac2_jax.viz import HEATMAP_CSS, esc, heatmap_html, kv_table, page
    facts = {"command": meta["command"], "seeds": list(cfg.seeds),
             "data seeds": meta.get("data_seeds"), "judge": cfg.loop.judge,
             "top_t": cfg.distill.top_t, "top_s": cfg.loop.get("judge_top_s"),
             "held-out hints followed": meta.get("hint_following"),
             "claims (fixed before the runs)": claims(cfg, runs),
             "llm judge vs the oracle": meta.get("llm_judge"),
             "wall_s": round(meta["wall_s"]), "devices": meta["devices"]}
    body = ["<h1>pinapple: hinted behaviour into the un-hinted model</h1>", kv_table(facts),
            "<h2>Methods (mean [95% CI] over seeds)</h2>",
            _html_table(*table_cells(cfg, rows)),
            "<h2>Held-out target and retention per step</h2>",
            _png(os.path.join(report_dir, "curves.png"))]
    sweep = summarize_sweep(cfg, runs)
    if sweep:
        body += ["<h2>RMSD over T, S and the judge</h2>",
                 _html_table(*sweep_cells(cfg, sweep)),
                 _png(os.path.join(report_dir, "sweep.png"))]
    seen = set()
    for r in runs:
        setting = r.get("setting") or {"top_t": cfg.distill.top_t,
                                       "top_s": cfg.loop.get("judge_top_s"),
                                       "judge": cfg.loop.judge, "kind": cfg.distill.kind}
        key = _setting_key(setting)
        if r["example"] is None or key in seen:
            continue
        seen.add(key)
        ex = r["example"]
        body += [f"<h2>RMSD's first update: judge {esc(setting['judge'])}, "
                 f"T={esc(setting['top_t'])}, S={esc(setting['top_s'])}, "
                 f"{esc(setting.get('kind', cfg.distill.kind))} (seed {r['seed']})</h2>",
                 kv_table({"student prompt": ex["prompt"], "hint": ex["hint"]}),
                 heatmap_html(ex["response_tokens"], ex["divergence"], ex["candidates"],
                              ex["selected"])]
    return page("pinapple report", "".join(body), css=HEATMAP_CSS)


def claims_markdown(cl: dict) -> str:
    """The claims (`claims`) as two lines of text."""
    lines = []
    h, r = cl.get("half_steps"), cl.get("retention")
    lines.append("- RMSD / OPSD steps to target: " + (
        "not enough paired runs" if h is None else
        f"{h['ratio']:.2f} [{h['low']:.2f}, {h['high']:.2f}] over {h['pairs']} pairs "
        f"(never reached: RMSD {h['censored']['rmsd']}, OPSD {h['censored']['opsd']}): "
        f"**{h['verdict']}**"))
    lines.append("- RMSD - SFT final retention: " + (
        "not enough paired runs" if r is None else
        f"{r['mean']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}] over {r['pairs']} pairs: "
        f"**{r['verdict']}**"))
    return "\n".join(lines)


def write_report(cfg, report_dir, runs, rows, meta) -> None:
    os.makedirs(report_dir, exist_ok=True)
    table = markdown_table(cfg, rows)
    with open(os.path.join(report_dir, "results.md"), "w") as f:
        f.write(f"# pinapple\n\n`{meta['command']}`\n\n"
                f"seeds {list(cfg.seeds)} x data seeds {meta.get('data_seeds')}; mean [95% CI] "
                "over runs (t interval, rates clipped to [0, 1]); steps to target: over the "
                "runs that reached it, checked "
                f"every {cfg.loop.target_every} steps. Retention: exact answers on all "
                "non-target items after the last step. Loss tokens / update: positions in the "
                f"loss per step (8 prompts).\n\n{table}\n\n"
                f"{claims_markdown(claims(cfg, runs))}\n\n"
                f"{meta['wall_s']:.0f}s wall, {meta['cpu_s']:.0f}s CPU on {meta['devices']}.\n")
    with open(os.path.join(report_dir, "results.json"), "w") as f:
        json.dump({"rows": rows, "claims": claims(cfg, runs),
                   "runs": [{k: v for k, v in r.items()} for r in runs],
                   "meta": meta, "config": cfg.to_dict()}, f, indent=1, default=str)
    plot_runs(cfg, runs, os.path.join(report_dir, "curves.png"))
    sweep = summarize_sweep(cfg, runs)
    if sweep:  # RMSD over T, S and the judge
        with open(os.path.join(report_dir, "sweep.md"), "w") as f:
            f.write(f"# pinapple: RMSD over T, S and the judge\n\nseeds {list(cfg.seeds)}; "
                    "mean [95% CI] over seeds.\n\n" + sweep_markdown(cfg, sweep) + "\n")
        with open(os.path.join(report_dir, "sweep.json"), "w") as f:
            json.dump(sweep, f, indent=1)
        plot_sweep(cfg, sweep, os.path.join(report_dir, "sweep.png"))
    with open(os.path.join(report_dir, "index.html"), "w", encoding="utf-8") as f:
        f.write(html_report(cfg, report_dir, runs, rows, meta))
    ex = next((r for r in runs if r["method"] == cfg.report.example_method
               and r.get("setting") is None and r["example"] is not None), None)
    if ex is not None:
        metrics = [{"step": t["step"], "loss": t["loss"]} for t in ex["train"]]
        metrics += [{k: e[k] for k in ("step", "target", "retention") if k in e}
                    for e in ex["evals"]]
        write_distill_report(os.path.join(report_dir, "distill_report.html"),
                             **ex["example"], metrics=metrics,
                             info={"method": ex["method"], "seed": ex["seed"],
                                   "judge": cfg.loop.judge, "top_t": cfg.distill.top_t},
                             title="pinapple: RMSD example (first update)")


def combine_sweeps(cfg, main_dir: str, sweep_dirs: list[str], out_dir: str) -> list[dict]:
    """One sweep table and plot from several runs of `experiments.pinapple` (each run's
    `runs.jsonl`): the sweep runs of `sweep_dirs`, plus the main run's RMSD runs as the
    main setting (`cfg`'s T, S, judge and divergence) on the sweeps' seeds only, so every
    row is over the same seeds. Writes sweep.md, sweep.json and sweep.png to `out_dir`."""
    swept = [r for d in sweep_dirs for r in read_runs(d) if r.get("setting") is not None]
    seeds = {r["seed"] for r in swept}
    main = {"top_t": cfg.distill.top_t, "top_s": cfg.loop.get("judge_top_s"),
            "judge": cfg.loop.judge, "kind": cfg.distill.kind}
    runs = [{**r, "setting": main} for r in read_runs(main_dir)
            if r["method"] == "rmsd" and r.get("setting") is None and r["seed"] in seeds]
    rows = summarize_sweep(cfg, runs + swept)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "sweep.md"), "w") as f:
        f.write(f"# pinapple: RMSD over T, S, the judge and the divergence\n\nseeds "
                f"{sorted(seeds)}; mean [95% CI] over seeds; runs from {main_dir} (the main "
                f"setting) and {', '.join(sweep_dirs)}.\n\n" + sweep_markdown(cfg, rows) + "\n")
    with open(os.path.join(out_dir, "sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    plot_sweep(cfg, rows, os.path.join(out_dir, "sweep.png"))
    return rows


def read_runs(run_dir: str) -> list[dict]:
    """The runs an `experiments.pinapple` run wrote as they ended (`runs.jsonl`)."""
    with open(os.path.join(run_dir, "runs.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def runs_summary(cfg, run_dir: str) -> str:
    """The methods table and the claims of the main runs a run has finished so far (from
    `runs.jsonl`; a run still going, or one whose report failed)."""
    runs = read_runs(run_dir)
    c = cfg.copy_and_resolve_references()
    with c.unlocked():
        c.methods = tuple(m for m in cfg.methods
                          if any(r["method"] == m and r.get("setting") is None for r in runs))
    zero = {k: 0.0 for k in METRICS}  # no base / teacher eval here: their rows are dropped
    rows = summarize(c, runs, zero, zero)[2:]
    seeds = sorted({(r["seed"], r.get("data_seed")) for r in runs}, key=str)
    return (f"{len(runs)} runs, (seed, data seed): {seeds}\n\n"
            + _md(*table_cells(cfg, rows)) + "\n\n"
            + claims_markdown(claims(cfg, runs)))


def main(argv):
    """`python -m experiments.pinapple.report --config=...:faithful --main_dir=D
    --sweep_dirs=D1,D2 --out_dir=O`: `combine_sweeps`; without --sweep_dirs: print
    `runs_summary` of D."""
    del argv
    if not _FLAGS.sweep_dirs:
        print(runs_summary(_CONFIG.value, _FLAGS.main_dir))
        return
    combine_sweeps(_CONFIG.value, _FLAGS.main_dir, _FLAGS.sweep_dirs, _FLAGS.out_dir)


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    _CONFIG = config_flags.DEFINE_config_file("config", "experiments/pinapple/config.py:faithful")
    flags.DEFINE_string("main_dir", None, "workdir of the main run", required=True)
    flags.DEFINE_list("sweep_dirs", [], "workdirs of the sweep runs (none: a summary)")
    flags.DEFINE_string("out_dir", None, "where the combined sweep goes")
    _FLAGS = flags.FLAGS
    app.run(main)
