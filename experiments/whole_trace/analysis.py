"""The ablation's analysis over seeds, fixed before the runs (issue 38).

Pre-registered (docs/notes/2026-12-06-whole-trace-claim-where-it-must-show.md):
- Primary outcome: held-out pass rate, whole trace minus main only. Per held-out
  task, the share of its attempts that passed in each arm of each seed; per task,
  the mean over seeds of (whole - main only); the estimate is the mean over tasks
  with a Student-t 95% interval over tasks (`pooled_arm_difference`). Every seed
  evaluates the same held-out tasks (`eval.task_seed`); a seed is the warm start's
  seed and RL's together. "Shown" means the interval excludes 0 above; "reversed",
  below; else "not shown".
- Secondary, the same way: the link's fidelity (memo fidelity: share of an
  attempt's judged memos that carry the value; per task, the share over its
  attempts), for every arm against main only; and per arm and seed the
  compactions per attempt and the main agent's calls right (counts).
- The reference arm (a dedicated memo reward) is read as: the share of its memo
  fidelity gain over main only that the whole trace's task reward recovers.
Whatever comes out is reported.
"""

from __future__ import annotations

import json
import os

import numpy as np

from ac2_jax.evals import mean_interval
from ac2_jax.trace import TraceStore
from experiments.calculator.long_horizon import FIDELITIES

PRIMARY = ("whole", "main_only")
LABELS = {"memo_ok": "memo fidelity", "helper_ok": "helper fidelity"}


def _eval_traces(store_path: str, eval_name: str):
    """The eval's scored attempts: infra errors (retried by `evaluate`, never scored)
    left out, and of an attempt stored twice (a resumed run) the last."""
    return list(_evals_in_store(store_path).get(eval_name, {}).values())


_STORE_CACHE: dict[str, tuple[tuple[int, int], dict]] = {}


def _evals_in_store(store_path: str) -> dict[str, dict]:
    """{eval name: {(task id, attempt): trace}} of a store, read once while the file is
    unchanged (size and mtime): the pooling asks each store for ~100 figures, and a
    long_memo seed's store holds every RL rollout besides its evals."""
    st = os.stat(store_path)
    stamp = (st.st_size, st.st_mtime_ns)
    hit = _STORE_CACHE.get(store_path)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    evals: dict[str, dict] = {}
    for t in TraceStore(store_path).read(on_error="skip"):
        meta = t.metadata or {}
        if meta.get("eval") is not None and t.status != "infra_error":
            evals.setdefault(meta["eval"], {})[(t.task_id, meta.get("attempt"))] = t
    _STORE_CACHE[store_path] = (stamp, evals)
    return evals


def _pass_by_task(traces) -> dict[str, float]:
    by_task: dict[str, list[float]] = {}
    for t in traces:
        by_task.setdefault(t.task_id, []).append(float((t.reward or 0.0) >= 1.0))
    return {k: float(np.mean(v)) for k, v in by_task.items()}


def _judged_by_task(traces, key: str) -> dict[str, float]:
    by_task: dict[str, list[float]] = {}
    for t in traces:
        by_task.setdefault(t.task_id, []).extend(
            float(e[key]) for e in t.events if e.get(key) is not None)
    return {k: float(np.mean(v)) for k, v in by_task.items() if v}


def eval_pass_by_task(store_path: str, eval_name: str) -> dict[str, float]:
    """{task id: share of its attempts that passed} over the eval `eval_name`'s traces
    in a store (an arm's `served_<arm>.jsonl` holds its RL rollouts and its eval)."""
    return _pass_by_task(_eval_traces(store_path, eval_name))


def eval_judged_by_task(store_path: str, eval_name: str, key: str = "memo_ok"
                        ) -> dict[str, float]:
    """{task id: share of its judged links (events carrying `key`) that were right},
    over tasks with at least one judged link."""
    return _judged_by_task(_eval_traces(store_path, eval_name), key)


def _eval_store_traces(workdir: str, eval_name: str) -> list:
    """The eval's scored attempts in a run's workdir: its traces carry metadata["eval"] =
    "sft" / "rl_<arm>" in the endpoint's store (`served.jsonl`; older runs kept one
    `served_<arm>.jsonl` per arm)."""
    return [t for f in sorted(os.listdir(workdir)) if f.startswith("served")
            and f.endswith(".jsonl") for t in _eval_traces(os.path.join(workdir, f), eval_name)]


def _per_task(workdir: str, arm: str, figure: str) -> dict[str, float]:
    """Per task figure ("pass", or an event key) of one arm's held-out eval in a run."""
    traces = _eval_store_traces(workdir, "sft" if arm == "sft" else f"rl_{arm}")
    return _pass_by_task(traces) if figure == "pass" else _judged_by_task(traces, figure)


def pooled_arm_difference(workdirs, a: str = "whole", b: str = "main_only",
                          figure: str = "pass", level: float = 0.95):
    """Arm a - arm b on the same held-out tasks, pooled over runs (seeds): per task,
    the mean over runs of (a - b), then a t interval over tasks. Only tasks every
    run has in both arms count. figure: "pass", or an event key ("memo_ok")."""
    per_run = []
    for w in workdirs:
        x, y = _per_task(w, a, figure), _per_task(w, b, figure)
        per_run.append({k: x[k] - y[k] for k in x.keys() & y.keys()})
    return _pooled(per_run, f"pooled_arm_difference({a} - {b}, {figure})", workdirs, level)


def pooled_arm_level(workdirs, arm: str, figure: str = "pass", level: float = 0.95):
    """One arm's figure pooled over runs: per task the mean over runs, t interval over tasks."""
    per_run = [_per_task(w, arm, figure) for w in workdirs]
    return _pooled(per_run, f"pooled_arm_level({arm}, {figure})", workdirs, level)


def _pooled(per_run, who, workdirs, level):
    tasks = sorted(set.intersection(*(set(d) for d in per_run)))
    if len(tasks) < 2:
        raise ValueError(f"{who}: {len(tasks)} tasks in common across {list(workdirs)}; the "
                         "runs must share their held-out tasks (and judge a link in them)")
    return mean_interval([float(np.mean([d[k] for d in per_run])) for k in tasks], level)


def _or_none(fn, *args):
    """`fn(*args).to_dict()`, or None where a judged figure has fewer than 2 tasks (an
    untrained model that wrote no judged memo); the pass rate always has its tasks."""
    try:
        return fn(*args).to_dict()
    except ValueError:
        if args[-1] == "pass":
            raise
        return None


def verdict(estimate) -> str:
    if estimate.low > 0:
        return "shown"
    if estimate.high < 0:
        return "reversed"
    return "not shown"


def recovered_share(whole_gain: float, ref_gain: float, ref_estimate: dict | None
                    ) -> tuple[float | None, str | None]:
    """(whole_gain / ref_gain, None) where the reference's own gain (`ref_estimate`, an
    Estimate's dict) excludes 0 above; else (None, why). A ratio over a gain that cannot
    be told from 0 says nothing: long_memo's three seeds (+0.002 [-0.011, +0.015]) gave
    a "share" of 10.6."""
    if ref_estimate is None or ref_estimate.get("low") is None or ref_estimate["low"] <= 0:
        return None, ("not defined: the dedicated memo reward's own fidelity gain over main "
                      f"only, {fmt_estimate(ref_estimate)}, does not exclude 0")
    return whole_gain / ref_gain, None


def pool_seeds(workdirs, report_dir: str, judged: str = "memo_ok",
               main_accuracy=None) -> dict:
    """The pooled analysis of per-seed ablation runs (each workdir holds one seed's
    `report/ablation.json` and stores): writes `pooled.json`, `pooled.md` and
    `curves.png` into `report_dir`; returns the pooled dict. `main_accuracy(traces,
    tokenizer)`, when given, recounts where the main agent slips from each run's eval
    traces (with the run's tokenizer) instead of taking the count its report holds."""
    reports = [json.load(open(os.path.join(w, "report", "ablation.json"))) for w in workdirs]
    arms = reports[0]["arms"]
    for field, want in (("arms", arms), ("judged", judged), ("rl_steps", reports[0]["rl_steps"]),
                        ("eval_tasks", reports[0]["eval_tasks"])):
        got = [r.get(field) for r in reports]
        if any(g != want for g in got):
            raise ValueError(f"pool_seeds: the runs differ in {field!r} ({got}; expected "
                             f"{want!r}): pool runs of one variant and config only")
    pooled = {"seeds": [r["seed"] for r in reports], "arms": arms, "judged": judged,
              "levels": {}, "differences": {}}
    for arm in ["sft"] + arms:
        pooled["levels"][arm] = {f: _or_none(pooled_arm_level, workdirs, arm, f)
                                 for f in ("pass", judged)}
    pairs = [("main_only", "sft")] + [(a, "main_only") for a in arms if a != "main_only"]
    for a, b in pairs:
        pooled["differences"][f"{a} - {b}"] = {
            f: _or_none(pooled_arm_difference, workdirs, a, b, f) for f in ("pass", judged)}
    primary = pooled_arm_difference(workdirs, *PRIMARY, "pass")
    pooled["primary"] = {"estimate": primary.to_dict(), "verdict": verdict(primary)}
    if "memo_reward" in arms:
        # Both gains over main only on the tasks judged in all three arms of every run.
        per = {a: [_per_task(w, a, judged) for w in workdirs]
               for a in ("memo_reward", "whole", "main_only")}
        tasks = set.intersection(*(set(d) for runs in per.values() for d in runs))

        def gain(a):
            return float(np.mean([np.mean([x[t] - y[t] for x, y in zip(
                per[a], per["main_only"], strict=True)]) for t in tasks])) if tasks else 0.0
        share, note = recovered_share(
            gain("whole"), gain("memo_reward"),
            pooled["differences"]["memo_reward - main_only"][judged])
        pooled["recovered_share"] = share
        if note:
            pooled["recovered_share_note"] = note
    if main_accuracy is not None:
        from ac2_jax.text import Tokenizer
        for w, r in zip(workdirs, reports, strict=True):
            tok = Tokenizer.from_pretrained(os.path.join(w, "tokenizer"))
            for name, e in r["evals"].items():
                e["main_requests"] = main_accuracy(_eval_store_traces(w, name), tok)
    pooled["per_seed"] = [{"seed": r["seed"], "evals": {
        name: {"pass_rate": e["pass_rate"], "fidelity": e["agents"][FIDELITIES[judged]],
               "compactions_per_attempt": e["agents"]["compactions_per_attempt"],
               "main_requests": e["main_requests"]} for name, e in r["evals"].items()},
        "differences": r["differences"]} for r in reports]
    pooled["curves"] = {arm: [r["rl_curves"][arm] for r in reports] for arm in arms}
    os.makedirs(report_dir, exist_ok=True)
    with open(os.path.join(report_dir, "pooled.json"), "w") as f:
        json.dump(pooled, f, indent=2)
    with open(os.path.join(report_dir, "pooled.md"), "w") as f:
        f.write(pooled_markdown(pooled))
    plot_curves(pooled, os.path.join(report_dir, "curves.png"))
    return pooled


def fmt_estimate(e) -> str:
    """An Estimate's dict as 'mean [low, high]' ('n/a' for a missing one or interval)."""
    if not e or e.get("low") is None:
        return "n/a" if not e else f"{e['mean']:.3f} [n/a]"
    return f"{e['mean']:.3f} [{e['low']:.3f}, {e['high']:.3f}]"


def _calls(m: dict) -> str:
    n = sum(m[k]["n"] for k in ("first_call", "later_call") if k in m)
    ok = sum(m[k]["correct"] for k in ("first_call", "later_call") if k in m)
    return f"{ok}/{n} ({ok / n:.3f})" if n else "n/a"


def pooled_markdown(p: dict) -> str:
    j, label = p["judged"], LABELS.get(p["judged"], p["judged"])
    pr = p["primary"]
    rows = [f"**Primary (pre-registered): held-out pass, whole - main only, pooled over seeds "
            f"{p['seeds']}: {fmt_estimate(pr['estimate'])} ({pr['estimate']['n']} tasks): "
            f"{pr['verdict']}.**", "",
            f"| arm | seed | pass rate [95% CI] | {label} [95% CI] | main calls right "
            "| compactions / attempt |", "|---|---|---|---|---|---|"]
    for arm in ["sft"] + p["arms"]:
        name = "sft" if arm == "sft" else f"rl_{arm}"
        for s in p["per_seed"]:
            e = s["evals"][name]
            rows.append(f"| {arm} | {s['seed']} | {fmt_estimate(e['pass_rate'])} "
                        f"| {fmt_estimate(e['fidelity'])} | {_calls(e['main_requests'])} "
                        f"| {e['compactions_per_attempt']:.2f} |")
        lv = p["levels"][arm]
        rows.append(f"| **{arm}** | pooled | {fmt_estimate(lv['pass'])} "
                    f"| {fmt_estimate(lv[j])} | | |")
    rows += ["", f"| pooled difference (per task over seeds) | pass [95% CI] | {label} [95% CI] |",
             "|---|---|---|"]
    for name, d in p["differences"].items():
        rows.append(f"| {name} | {fmt_estimate(d['pass'])} | {fmt_estimate(d[j])} |")
    rows += ["", "| per-seed difference (paired t over tasks) | "
             + " | ".join(f"seed {s['seed']}: pass" for s in p["per_seed"]) + " |",
             "|---|" + "---|" * len(p["per_seed"])]
    for name in p["per_seed"][0]["differences"]:
        rows.append(f"| {name} | " + " | ".join(fmt_estimate(s["differences"][name]["pass"])
                                               for s in p["per_seed"]) + " |")
    if p.get("recovered_share") is not None:
        rows += ["", f"Share of the dedicated memo reward's fidelity gain over main only that "
                 f"the whole trace recovers: {p['recovered_share']:.2f}."]
    elif p.get("recovered_share_note"):
        rows += ["", "Share of the dedicated memo reward's fidelity gain that the whole trace "
                 f"recovers: {p['recovered_share_note']}."]
    return "\n".join(rows) + "\n"


def plot_curves(p: dict, path: str) -> None:
    """Per RL step and arm: the rollouts' pass rate and memo fidelity (each step's tasks
    are fresh, not yet trained on; thin lines per seed, thick the mean over seeds);
    and the held-out pass and fidelity after RL, pooled over seeds (95% CIs)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4))
    axes = fig.subplots(1, 3)
    colors = {}
    for k, (arm, runs) in enumerate(p["curves"].items()):
        color = colors.setdefault(arm, f"C{k}")
        for ax, key in zip(axes[:2], ("pass_rate", "fidelity"), strict=True):
            series = []
            for run in runs:
                xs = [c["rl_step"] for c in run if c[key] is not None]
                ys = [c[key] for c in run if c[key] is not None]
                ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8)
                series.append(dict(zip(xs, ys, strict=True)))
            steps = sorted(set.intersection(*(set(s) for s in series)))
            ax.plot(steps, [np.mean([s[x] for s in series]) for x in steps], color=color,
                    linewidth=2, label=arm)
    axes[0].set(title="rollout pass rate (fresh tasks)", xlabel="RL step")
    label = LABELS.get(p["judged"], p["judged"])
    axes[1].set(title=f"rollout {label}", xlabel="RL step")
    axes[0].legend(fontsize=8)
    names = ["sft"] + p["arms"]
    for off, (fig_key, marker) in enumerate((("pass", "o"), (p["judged"], "s"))):
        shown = [(i, p["levels"][a][fig_key]) for i, a in enumerate(names)
                 if p["levels"][a][fig_key] is not None]
        if not shown:
            continue
        means = np.array([e["mean"] for _, e in shown])
        err = [means - [e["low"] for _, e in shown], [e["high"] for _, e in shown] - means]
        xs = np.array([i for i, _ in shown]) + (off - 0.5) * 0.3
        axes[2].errorbar(xs, means, yerr=err, fmt=marker, capsize=3,
                         label="held-out pass" if off == 0 else f"held-out {label}")
    axes[2].set_xticks(np.arange(len(names)), names, rotation=20, fontsize=8)
    axes[2].set(title="after RL, pooled over seeds (95% CI)", ylim=(0, 1))
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
