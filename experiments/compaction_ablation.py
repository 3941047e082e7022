"""Does training the compactor by task reward teach it anything? (issue 18)

    python experiments/compaction_ablation.py --config=experiments/configs/calculator.py:long \
        --config.workdir=runs/compaction_ablation

SFT once, then RL twice from the same SFT weights with the same seeds: the
whole trace in the loss (main and compactor episodes) vs the main agent's
episodes only (`rl.batch.train_agents=("main",)`). Then the same held-out
eval of SFT, RL-whole and RL-main-only: pass rate and memo fidelity (share of
memos that carry the running value) with 95% CIs, and paired differences.
Writes `workdir/report/ablation.json` and `ablation.md`; per RL step, the
train pass rate and memo fidelity of each arm from its rollouts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ac2_jax.evals import compare_results, evaluate, mean_interval  # noqa: E402
from ac2_jax.models.params_io import restore_params  # noqa: E402
from ac2_jax.trace import TraceStore  # noqa: E402
from experiments import calculator_agent as ca  # noqa: E402
from experiments import long_horizon  # noqa: E402

ARMS = {"whole": None, "main_only": ("main",)}


def arm_config(rl_config, train_agents):
    """The RL config of one arm: the same in all but `batch.train_agents`."""
    fields = {f.name for f in dataclasses.fields(rl_config.batch)}
    if "train_agents" not in fields:
        raise RuntimeError("compaction_ablation: BatchConfig has no train_agents field (the "
                           "main-only arm needs it); update the branch that adds it")
    return dataclasses.replace(rl_config, batch=dataclasses.replace(
        rl_config.batch, train_agents=train_agents))


def step_curves(store_path: str) -> list[dict]:
    """Per RL step of stored rollouts: train pass rate and memo fidelity (pooled)."""
    by_step: dict[int, list] = {}
    for t in TraceStore(store_path).read(on_error="skip"):
        step = (t.metadata or {}).get("rl_step")
        if step is not None:
            by_step.setdefault(int(step), []).append(t)
    out = []
    for step in sorted(by_step):
        ts = by_step[step]
        memos = [e["memo_ok"] for t in ts for e in t.events if "memo_ok" in e]
        out.append({"rl_step": step, "traces": len(ts),
                    "pass_rate": float(np.mean([(t.reward or 0.0) >= 1.0 for t in ts])),
                    "memo_fidelity": float(np.mean(memos)) if memos else None,
                    "memos": len(memos)})
    return out


def eval_pass_by_task(store_path: str, eval_name: str) -> dict[str, float]:
    """{task id: share of its attempts that passed} over the eval `eval_name`'s traces
    in a store (an arm's `served_<arm>.jsonl` holds its RL rollouts and its eval)."""
    by_task: dict[str, list[float]] = {}
    for t in TraceStore(store_path).read(on_error="skip"):
        if (t.metadata or {}).get("eval") == eval_name:
            by_task.setdefault(t.task_id, []).append(float((t.reward or 0.0) >= 1.0))
    return {k: float(np.mean(v)) for k, v in by_task.items()}


def pooled_arm_difference(workdirs, level: float = 0.95):
    """Whole - main-only pass rate pooled over ablation runs on the same held-out tasks
    (e.g. two warm starts): per task, the mean over runs of (whole - main-only), then a
    t interval over tasks. Only tasks every run evaluated in both arms count."""
    per_run = []
    for w in workdirs:
        whole = eval_pass_by_task(os.path.join(w, "served_whole.jsonl"), "rl_whole")
        main = eval_pass_by_task(os.path.join(w, "served_main_only.jsonl"), "rl_main_only")
        per_run.append({k: whole[k] - main[k] for k in whole.keys() & main.keys()})
    tasks = sorted(set.intersection(*(set(d) for d in per_run)))
    if len(tasks) < 2:
        raise ValueError(f"pooled_arm_difference: {len(tasks)} tasks in common across "
                         f"{list(workdirs)}; the runs must share their held-out tasks")
    return mean_interval([float(np.mean([d[k] for d in per_run])) for k in tasks], level)


def _est(e) -> str:
    return f"{e['mean']:.3f} [{e['low']:.3f}, {e['high']:.3f}]" if e else "n/a"


def markdown(report: dict) -> str:
    rows = ["| held-out eval | pass rate [95% CI] | memo fidelity [95% CI] | memos judged "
            "| compactions / attempt | episodes / trace |", "|---|---|---|---|---|---|"]
    for name in ("sft", "rl_whole", "rl_main_only"):
        r, a = report["evals"][name], report["evals"][name]["agents"]
        rows.append(f"| {name} | {_est(r['pass_rate'])} | {_est(a['memo_fidelity'])} "
                    f"| {a['memos_judged']} | {a['compactions_per_attempt']:.2f} "
                    f"| {a['episodes_per_trace']:.2f} |")
    rows += ["", "| paired difference (tasks) | pass rate [95% CI] | memo fidelity [95% CI] |",
             "|---|---|---|"]
    for name, d in report["differences"].items():
        rows.append(f"| {name} | {_est(d['pass'])} | {_est(d['memo_fidelity'])} |")
    rows += ["", "| held-out eval | main: first calls right | later calls right | answers right |",
             "|---|---|---|---|"]
    for name in ("sft", "rl_whole", "rl_main_only"):
        m = report["evals"][name].get("main_requests", {})
        cells = [f"{m[k]['correct']}/{m[k]['n']} ({m[k]['rate']:.3f})" if k in m else "n/a"
                 for k in ("first_call", "later_call", "answer")]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    methods = {e["pass_rate"]["method"] for e in report["evals"].values()}
    rows += ["", f"{report['eval_tasks']} held-out tasks x {report['eval_attempts']} attempt(s); "
             f"pass rate CI: {', '.join(sorted(methods))}; memo fidelity CI: clustered-t over "
             "tasks; differences: paired t over tasks.", "",
             "| RL step | whole: train pass | whole: memo fidelity | main only: train pass "
             "| main only: memo fidelity |", "|---|---|---|---|---|"]
    curves = report["rl_curves"]
    for i in range(max(len(c) for c in curves.values())):
        cells = []
        for arm in ARMS:
            c = curves[arm][i] if i < len(curves[arm]) else None
            cells += [f"{c['pass_rate']:.3f}" if c else "", f"{c['memo_fidelity']:.3f}"
                      if c and c["memo_fidelity"] is not None else ""]
        rows.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


async def _run(cfg, log=print) -> dict:
    t_start = time.perf_counter()
    rl_config = ca.typed_configs(cfg)["rl"]
    arms = {arm: arm_config(rl_config, agents) for arm, agents in ARMS.items()}  # fail early
    workdir = os.path.abspath(cfg.workdir)
    report_dir = os.path.join(workdir, "report")
    os.makedirs(report_dir, exist_ok=True)
    env, tokenizer, model, sft_history, t_sft = ca.prepare(cfg, workdir, log)
    sft_dir = os.path.join(workdir, "sft_params")
    eval_tasks, eval_make, eval_kw = ca.eval_plan(cfg, env)
    results, times, curves = {}, {"sft": t_sft}, {}
    async with ca.serving(cfg, model, tokenizer, os.path.join(workdir, "sft_published"),
                          cfg.eval.concurrency, os.path.join(workdir, "served_sft.jsonl")
                          ) as (_, lifecycle):
        t0 = time.perf_counter()
        results["sft"] = await evaluate(lifecycle, env, eval_tasks, eval_make, ca.MODEL_NAME,
                                        name="sft", **eval_kw)
        times["eval_sft"] = time.perf_counter() - t0
        log(f"SFT: pass rate {results['sft'].pass_rate}")
    for arm, arm_rl in arms.items():
        arm_model = ca.build_model(cfg, tokenizer.vocab_size)
        restore_params(arm_model, sft_dir)  # both arms start from the same SFT weights
        rl_dir = os.path.join(workdir, f"rl_{arm}")
        async with ca.serving(cfg, arm_model, tokenizer, os.path.join(rl_dir, "published"),
                              arm_rl.concurrency, os.path.join(workdir, f"served_{arm}.jsonl")
                              ) as (sampler, lifecycle):
            t0 = time.perf_counter()
            await ca.train_rl(cfg, arm_rl, arm_model, sampler, lifecycle, env, rl_dir,
                              os.path.join(report_dir, f"metrics_{arm}"))
            times[f"rl_{arm}"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            results[f"rl_{arm}"] = await evaluate(lifecycle, env, eval_tasks, eval_make,
                                                  ca.MODEL_NAME, name=f"rl_{arm}", **eval_kw)
            times[f"eval_rl_{arm}"] = time.perf_counter() - t0
            log(f"RL ({arm}): pass rate {results[f'rl_{arm}'].pass_rate}")
        curves[arm] = step_curves(os.path.join(rl_dir, "rollouts.jsonl"))

    def diff(a, b):
        memo = long_horizon.memo_fidelity_difference(results[a], results[b])
        return {"pass": compare_results(results[a], results[b], "pass").estimate.to_dict(),
                "memo_fidelity": memo.to_dict() if memo else None}

    times["total"] = time.perf_counter() - t_start
    report = {
        "evals": {name: {"pass_rate": r.pass_rate.to_dict(),
                         "agents": long_horizon.agent_figures(r),
                         "main_requests": long_horizon.main_request_accuracy(r.traces, tokenizer)}
                  for name, r in results.items()},
        "differences": {"rl_whole - sft": diff("rl_whole", "sft"),
                        "rl_main_only - sft": diff("rl_main_only", "sft"),
                        "rl_whole - rl_main_only": diff("rl_whole", "rl_main_only")},
        "rl_curves": curves, "eval_tasks": len(eval_tasks), "eval_attempts": cfg.eval.attempts,
        "rl_steps": rl_config.steps, "times_s": times,
        "sft_final_loss": sft_history[-1]["loss"] if sft_history else None,
        "load_average": os.getloadavg(),
    }
    with open(os.path.join(report_dir, "ablation.json"), "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.join(report_dir, "ablation.md"), "w") as f:
        f.write(markdown(report))
    return report


def run(cfg, log=print) -> dict:
    """The ablation; returns the report dict (also written to workdir/report)."""
    if not ca.is_long(cfg):
        raise ValueError("compaction_ablation needs the compacting harness: use "
                         "--config=experiments/configs/calculator.py:long (or long_quick)")
    return asyncio.run(_run(cfg, log))


def main(argv):
    del argv
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    report = run(_CONFIG.value)
    print(open(os.path.join(_CONFIG.value.workdir, "report", "ablation.md")).read())
    print(json.dumps(report["times_s"]))


if __name__ == "__main__":
    from absl import app
    from ml_collections import config_flags
    _CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/calculator.py:long")
    app.run(main)
