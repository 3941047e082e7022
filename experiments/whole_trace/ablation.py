"""Does training the compactor by the task reward teach it anything? (issues 18, 38)

    python -m experiments.whole_trace --config=experiments/calculator/config.py:long_memo \
        --config.workdir=runs/long_memo --seeds=3

Per seed: SFT once, then RL once per arm from the same SFT weights with the same
RL seeds; the arms differ only in which episodes are in the loss and what
rewards them (`ARMS`):
  whole           every episode (main and compactor), the task reward
  main_only       the main agent's episodes only (`rl.batch.train_agents=("main",)`)
  compactor_only  the compactor's episodes only
  memo_reward     the compactor's episodes only, rewarded by the attempt's memo
                  fidelity (share of its memos that carry the value) instead of the
                  task: a dedicated summary reward, the upper-bound reference
The config's `ablation.arms` picks them (`long`: whole and main_only). Then the
same held-out eval of SFT and every arm: pass rate and memo fidelity with 95%
CIs, paired differences, where the main agent slips, and per RL step the
rollouts' pass rate and memo fidelity. Writes `<seed workdir>/report/ablation.json`
and `ablation.md`; with --seeds=N the seeds are `seed`..`seed+N-1` (both the
warm start's and RL's), each in `workdir/seed_<k>`, and `ablation_analysis`
pools them into `workdir/report/pooled.{json,md}` and `curves.png`.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from ac2_jax.evals import compare_results, evaluate  # noqa: E402
from ac2_jax.models.io.params_io import restore_params  # noqa: E402
from ac2_jax.trace import TraceStore  # noqa: E402
from ac2_jax.training.rl.collectors import EndpointCollector  # noqa: E402
from experiments.calculator import agent as ca  # noqa: E402
from experiments.calculator import long_horizon  # noqa: E402
from experiments.whole_trace.analysis import (  # noqa: E402,F401 (re-exported)
    eval_pass_by_task,
    fmt_estimate,
    pool_seeds,
    pooled_arm_difference,
)


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm: the agents whose episodes are in the loss (None: all) and the reward."""

    train_agents: tuple[str, ...] | None
    reward: str = "task"  # "task" (the verifier's) or "memo" (the attempt's memo fidelity)


ARMS = {"whole": Arm(None), "main_only": Arm(("main",)),
        "compactor_only": Arm(("compactor",)), "memo_reward": Arm(("compactor",), "memo"),
        "helper_only": Arm(("subagent:helper",))}
DEFAULT_ARMS = ("whole", "main_only")


def memo_fidelity(trace) -> float:
    """Share of the attempt's judged memos that carry the value (0 when none was judged:
    the attempt ended before its first compaction, so it holds no compactor tokens to
    train and only lowers its group's mean)."""
    judged = [float(e["memo_ok"]) for e in trace.events if e.get("memo_ok") is not None]
    return float(np.mean(judged)) if judged else 0.0


class MemoRewardCollector(EndpointCollector):
    """The endpoint's rollouts with each trace's reward replaced by its memo fidelity
    (the store keeps the task reward, so the curves still show the task's pass rate)."""

    @staticmethod
    def _rewarded(traces):
        return [t if t.status == "infra_error" else dataclasses.replace(
            t, reward=memo_fidelity(t)) for t in traces]

    async def collect(self, rl_step: int):
        return self._rewarded(await super().collect(rl_step))

    async def refill(self, rl_step: int, round: int, n: int):
        traces, skipped = await super().refill(rl_step, round, n)
        return self._rewarded(traces), skipped

    def stored(self, rl_step: int):
        return self._rewarded(super().stored(rl_step))


# Arms that need an agent only one harness has.
_HARNESS_OF = {"compactor_only": "compaction", "memo_reward": "compaction",
               "helper_only": "subagent"}


def arm_names(cfg) -> tuple[str, ...]:
    names = tuple(cfg.get("ablation", {}).get("arms", DEFAULT_ARMS))
    unknown = [n for n in names if n not in ARMS]
    if not names or unknown or names[:2] != ("whole", "main_only"):
        raise ValueError(f"ablation.arms must name arms of {sorted(ARMS)}, starting with "
                         f"'whole', 'main_only' (the primary comparison), got {names}")
    kind = ca.harness_kind(cfg)
    misfit = [n for n in names if _HARNESS_OF.get(n, kind) != kind]
    if misfit:
        raise ValueError(f"ablation.arms {misfit} train an agent the {kind!r} harness does not "
                         f"run (each needs: {[_HARNESS_OF[n] for n in misfit]})")
    return names


def arm_config(rl_config, train_agents):
    """The RL config of one arm: the same in all but `batch.train_agents`."""
    fields = {f.name for f in dataclasses.fields(rl_config.batch)}
    if "train_agents" not in fields:
        raise RuntimeError("experiments.whole_trace: BatchConfig has no train_agents field (the "
                           "main-only arm needs it); update the branch that adds it")
    return dataclasses.replace(rl_config, batch=dataclasses.replace(
        rl_config.batch, train_agents=train_agents))


def step_curves(store_path: str, key: str = "memo_ok") -> list[dict]:
    """Per RL step of stored rollouts: the task pass rate and the fidelity of the link
    the events' `key` judges (memos; helper answers), pooled. Each step's tasks are
    fresh draws the policy has not trained on yet."""
    by_step: dict[int, list] = {}
    for t in TraceStore(store_path).read(on_error="skip"):
        step = (t.metadata or {}).get("rl_step")
        if step is not None:
            by_step.setdefault(int(step), []).append(t)
    out = []
    for step in sorted(by_step):
        ts = by_step[step]
        judged = [e[key] for t in ts for e in t.events if e.get(key) is not None]
        out.append({"rl_step": step, "traces": len(ts),
                    "pass_rate": float(np.mean([(t.reward or 0.0) >= 1.0 for t in ts])),
                    "fidelity": float(np.mean(judged)) if judged else None,
                    "judged": len(judged)})
    return out


def markdown(report: dict) -> str:
    names, key = list(report["evals"]), report["judged"]
    figure = long_horizon.FIDELITIES[key]
    label = figure.replace("_", " ")
    rows = [f"| held-out eval | pass rate [95% CI] | {label} [95% CI] | judged "
            "| compactions / attempt | episodes / trace |", "|---|---|---|---|---|---|"]
    for name in names:
        r, a = report["evals"][name], report["evals"][name]["agents"]
        rows.append(f"| {name} | {fmt_estimate(r['pass_rate'])} | {fmt_estimate(a[figure])} "
                    f"| {a[f'{key}_judged']} | {a['compactions_per_attempt']:.2f} "
                    f"| {a['episodes_per_trace']:.2f} |")
    rows += ["", f"| paired difference (tasks) | pass rate [95% CI] | {label} [95% CI] |",
             "|---|---|---|"]
    for name, d in report["differences"].items():
        rows.append(f"| {name} | {fmt_estimate(d['pass'])} | {fmt_estimate(d['fidelity'])} |")
    rows += ["", "| held-out eval | main: first calls right | later calls right | answers right |",
             "|---|---|---|---|"]
    for name in names:
        m = report["evals"][name].get("main_requests", {})
        cells = [f"{m[k]['correct']}/{m[k]['n']} ({m[k]['rate']:.3f})" if k in m else "n/a"
                 for k in ("first_call", "later_call", "answer")]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    methods = {e["pass_rate"]["method"] for e in report["evals"].values()}
    curves = report["rl_curves"]
    rows += ["", f"{report['eval_tasks']} held-out tasks x {report['eval_attempts']} attempt(s); "
             f"pass rate CI: {', '.join(sorted(methods))}; {label} CI: clustered-t over "
             "tasks; differences: paired t over tasks.", "",
             "| RL step | " + " | ".join(f"{a}: rollout pass | {a}: {label}"
                                        for a in curves) + " |",
             "|---|" + "---|---|" * len(curves)]
    for i in range(max(len(c) for c in curves.values())):
        cells = []
        for arm in curves:
            c = curves[arm][i] if i < len(curves[arm]) else None
            cells += [f"{c['pass_rate']:.3f}" if c else "", f"{c['fidelity']:.3f}"
                      if c and c["fidelity"] is not None else ""]
        rows.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


async def _run(cfg, log=print) -> dict:
    t_start = time.perf_counter()
    rl_config = ca.typed_configs(cfg)["rl"]
    arms = {name: (arm_config(rl_config, ARMS[name].train_agents), ARMS[name])
            for name in arm_names(cfg)}  # fail early
    key = ca.judged_key(cfg)
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
    for name, (arm_rl, arm) in arms.items():
        arm_model = ca.build_model(cfg, tokenizer.vocab_size)
        restore_params(arm_model, sft_dir)  # every arm starts from the same SFT weights
        rl_dir = os.path.join(workdir, f"rl_{name}")
        async with ca.serving(cfg, arm_model, tokenizer, os.path.join(rl_dir, "published"),
                              arm_rl.concurrency, os.path.join(workdir, f"served_{name}.jsonl")
                              ) as (sampler, lifecycle):
            t0 = time.perf_counter()
            await ca.train_rl(cfg, arm_rl, arm_model, sampler, lifecycle, env, rl_dir,
                              os.path.join(report_dir, f"metrics_{name}"),
                              collector_cls=(MemoRewardCollector if arm.reward == "memo"
                                             else EndpointCollector))
            times[f"rl_{name}"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            results[f"rl_{name}"] = await evaluate(lifecycle, env, eval_tasks, eval_make,
                                                   ca.MODEL_NAME, name=f"rl_{name}", **eval_kw)
            times[f"eval_rl_{name}"] = time.perf_counter() - t0
            log(f"RL ({name}): pass rate {results[f'rl_{name}'].pass_rate}")
        curves[name] = step_curves(os.path.join(rl_dir, "rollouts.jsonl"), key)

    def diff(a, b):
        link = long_horizon.memo_fidelity_difference(results[a], results[b], key)
        return {"pass": compare_results(results[a], results[b], "pass").estimate.to_dict(),
                "fidelity": link.to_dict() if link else None}

    differences = {f"rl_{n} - sft": diff(f"rl_{n}", "sft") for n in arms}
    differences.update({f"rl_{n} - rl_main_only": diff(f"rl_{n}", "rl_main_only")
                        for n in arms if n != "main_only"})
    times["total"] = time.perf_counter() - t_start
    report = {
        "seed": cfg.seed, "arms": list(arms), "judged": key,
        "evals": {name: {"pass_rate": r.pass_rate.to_dict(),
                         "agents": long_horizon.agent_figures(r),
                         "main_requests": ca.main_request_accuracy(cfg, r.traces, tokenizer)}
                  for name, r in results.items()},
        "differences": differences,
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
    """The ablation for `cfg.seed`; returns the report dict (also written to workdir/report)."""
    if not ca.is_long(cfg):
        raise ValueError("experiments.whole_trace needs a multi-agent harness: use "
                         "--config=experiments/calculator/config.py:long (or long_memo, "
                         "sub_helper)")
    return asyncio.run(_run(cfg, log))


def seed_workdir(workdir: str, seed: int) -> str:
    return os.path.join(workdir, f"seed_{seed}")


def seed_config(cfg, seed: int):
    """`cfg` for one seed: the warm start's and RL's seeds, in `workdir/seed_<seed>`."""
    one = cfg.copy_and_resolve_references()
    # The copy holds the sections' seeds as values, no longer references to `seed`.
    one.seed, one.sft.seed, one.rl.seed = seed, seed, seed
    one.workdir = seed_workdir(cfg.workdir, seed)
    return one


def run_seeds(cfg, seeds: int, log=print) -> dict:
    """The ablation for seeds `cfg.seed`..`cfg.seed + seeds - 1`, each in its own
    `workdir/seed_<k>` (a finished seed's report is reused), then pooled
    (`ablation_analysis.pool_seeds`). Returns the pooled report."""
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    if seeds > 1 and cfg.eval.get("task_seed") is None:
        raise ValueError("--seeds > 1 pools per held-out task, so every seed must evaluate the "
                         "same tasks: set --config.eval.task_seed (long_memo and sub_helper do)")
    workdirs = []
    for k in range(cfg.seed, cfg.seed + seeds):
        one = seed_config(cfg, k)
        workdirs.append(one.workdir)
        if os.path.exists(os.path.join(one.workdir, "report", "ablation.json")):
            log(f"seed {k}: report found in {one.workdir}, reused")
            continue
        log(f"seed {k}: ablation in {one.workdir}")
        run(one, log)
    return pool_seeds(workdirs, os.path.join(cfg.workdir, "report"), ca.judged_key(cfg),
                      lambda traces, tok: ca.main_request_accuracy(cfg, traces, tok))


def main(argv):
    del argv
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = _CONFIG.value
    if _SEEDS.value is None:
        report = run(cfg)
        print(open(os.path.join(cfg.workdir, "report", "ablation.md")).read())
        print(json.dumps(report["times_s"]))
    else:
        run_seeds(cfg, _SEEDS.value)
        print(open(os.path.join(cfg.workdir, "report", "pooled.md")).read())


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags
    _CONFIG = config_flags.DEFINE_config_file("config", "experiments/calculator/config.py:long")
    _SEEDS = flags.DEFINE_integer("seeds", None, "Run seeds seed..seed+N-1 (each in "
                                  "workdir/seed_<k>) and pool them; unset: one run in workdir.")
    app.run(main)
