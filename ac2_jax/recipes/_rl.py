"""The RL recipe: task-level RL of any model on any environment.

    from ac2_jax import recipes
    report = recipes.rl("path/to/hf_model", "my_pkg.envs:MyEnv", recipes.RLRecipeConfig())

Each step the collector runs `rl.tasks_per_step` x `rl.attempts_per_task`
attempts through the endpoint (the env's harness or the tool loop), the
verifier rewards each trace, and `RLTrainer` trains every episode of every
trace, checkpoints, and publishes the weights the sampler serves next. With
`eval.num_tasks` > 0 held-out tasks are evaluated before and after. A
killed run resumes from its checkpoint with no rollout lost (the store) when
asked (`paths.existing="resume"`, the launcher's --resume; see `claim_workdir`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ac2_jax._sync import run_sync
from ac2_jax.config import ConfigError
from ac2_jax.envs.contract import check_env, load_env
from ac2_jax.envs.mixer import AdaptiveMix, DomainMixer
from ac2_jax.recipes.common import (
    Progress,
    RecipeResult,
    check_model,
    claim_workdir,
    error_lines,
    export_model,
    hands_off_in_memory,
    harness_factory,
    load_model,
    metrics_logger,
    recipe_mesh,
    resuming_line,
    run_report,
    serve_policy,
    setting_failure,
    tool_parser_line,
    write_json,
    write_learning_curve,
    write_trace_pages,
)
from ac2_jax.recipes.config import RLRecipeConfig

__all__ = ["arl", "eval_before", "evaluate_policy", "mix_lines", "rl", "write_mix_report"]


async def evaluate_policy(cfg, env, lifecycle, name: str, progress: Progress, harness=None):
    """The held-out eval of `cfg.eval` through the endpoint (None when num_tasks is 0)."""
    from ac2_jax.evals import TokenPrices, evaluate

    if cfg.eval.num_tasks <= 0:
        return None
    tasks = env.sample_tasks(cfg.eval.num_tasks, seed=cfg.seed, split="eval")
    sampling = {"temperature": cfg.eval.temperature, "max_tokens": cfg.rollout.max_tokens}
    make = (harness or harness_factory)(sampling, cfg.rollout.max_steps)
    prices = TokenPrices(**cfg.eval.prices) if cfg.eval.prices else None
    t0 = time.perf_counter()
    result = await evaluate(
        lifecycle, env, tasks, make, cfg.sampler.model_name, name=name, k=cfg.eval.attempts,
        concurrency=cfg.eval.concurrency, seed=cfg.seed, prices=prices,
    )  # fmt: skip
    progress.say(
        f"eval {name}: pass rate {result.pass_rate.mean:.3f} over {len(tasks)} tasks x "
        f"{cfg.eval.attempts} ({time.perf_counter() - t0:.0f}s)"
    )
    return result


def _eval_key(cfg) -> dict[str, Any]:
    """What makes two held-out evals of a run comparable (same tasks, attempts, seeds)."""
    e = cfg.eval
    return {"num_tasks": e.num_tasks, "attempts": e.attempts, "temperature": e.temperature,
            "seed": cfg.seed, "max_tokens": cfg.rollout.max_tokens}  # fmt: skip


def _load_eval(d: dict[str, Any]):
    """An `EvalResult` back from its `to_dict` (attempts and headline; no traces)."""
    from ac2_jax.evals import AttemptRecord, EvalResult, PrefixStats, TokenPrices

    def record(a: dict[str, Any]) -> AttemptRecord:
        p = dict(a["prefix"])
        share = (p.pop("mean_request_share") or 0.0) * p["requests"]
        p.pop("reusable_share"), p.pop("cached_share")
        return AttemptRecord(**{**a, "prefix": PrefixStats(**p, share_sum=share)})

    tasks = list(dict.fromkeys(a["task_id"] for a in d["attempts"]))
    prices = TokenPrices(**d["prices"]) if d.get("prices") else None
    return EvalResult(d["name"], tasks, d["k"], [record(a) for a in d["attempts"]],
                      d["level"], prices)  # fmt: skip


async def eval_before(cfg, env, lifecycle, progress: Progress, resume_at: int, harness=None):
    """The held-out eval before training, of the base model: run at the run's start and
    kept (paths.reports/eval_before.json); a resumed run (`resume_at` > 0) serves a
    trained model, so it reuses the kept one (evaluated with the same eval settings)
    and never evaluates the resumed model as if it were the base. None (and a console
    line saying why) when there is none to compare with."""
    if cfg.eval.num_tasks <= 0:
        return None
    path = os.path.join(cfg.paths.resolved().reports, "eval_before.json")
    if not resume_at:
        result = await evaluate_policy(cfg, env, lifecycle, "before", progress, harness)
        write_json(path, {"step": 0, "settings": _eval_key(cfg), "result": result.to_dict()})
        return result
    kept = None
    if os.path.exists(path):
        with open(path) as f:
            kept = json.load(f)
    if kept is None:
        progress.say(
            f"eval before: none was run at the run's start, and the resumed model (step "
            f"{resume_at}) is not the base: no before/after comparison"
        )
        return None
    if kept["settings"] != _eval_key(cfg):
        progress.say(
            f"eval before: the run's start was evaluated with {kept['settings']}, this run "
            f"asks {_eval_key(cfg)}: no before/after comparison"
        )
        return None
    result = _load_eval(kept["result"])
    progress.say(
        f"eval before: kept from the run's start (step {kept['step']}): pass rate "
        f"{result.pass_rate.mean:.3f} (the resumed model is not the base; not re-run)"
    )
    return result


def _mixed(env, cfg: RLRecipeConfig):
    """The env with `cfg.mix` applied: adaptive weights for a DomainMixer (a fresh
    mixer over its domains and fixed weights); adaptive for one env is refused."""
    mix = cfg.mix
    if not mix.adaptive:
        return env
    if not isinstance(env, DomainMixer):
        raise ConfigError(
            f"mix.adaptive=true needs an env of several domains (a DomainMixer, e.g. "
            f"--env=reasoning_gym:chain_sum,gcd); {type(env).__name__} is one"
        )
    adaptive = AdaptiveMix(
        window=mix.window, floor=mix.floor, min_results=mix.min_results,
        pass_threshold=mix.pass_threshold,
    )  # fmt: skip
    return DomainMixer(env.envs, env.weights, adaptive=adaptive)


def _audit_domains(env: DomainMixer, reports: str, progress: Progress) -> None:
    """The verifier audit of every domain (`envs.adapters.verifier_audit`: a reference
    answer rejected, a wrong answer accepted), written to reports/env_audit.json and
    said on the console."""
    from ac2_jax.envs.adapters import verifier_audit

    audit = verifier_audit(env)
    write_json(os.path.join(reports, "env_audit.json"), audit)
    flagged = audit["flagged"]
    words = []
    for d in flagged:
        found = audit["domains"][d]
        why = []
        if found["rejects_reference"]:
            why.append(f"rejects {len(found['rejects_reference'])} reference answers")
        if found["accepts_wrong"]:
            why.append(f"accepts {len(found['accepts_wrong'])} wrong answers")
        if found.get("raises_on_wrong"):
            why.append(f"raises on {len(found['raises_on_wrong'])} wrong answers")
        words.append(f"{d} ({', '.join(why)})")
    progress.say(
        f"env audit of {len(env.envs)} domains: "
        + (f"flagged {'; '.join(words)}" if flagged else "no verifier flagged")
        + " (report/env_audit.json)"
    )


def mix_lines(step: int, m: dict[str, Any], width: int = 100) -> list[str]:
    """The console's word on an adaptive mix after a step: each domain's weight and
    rolling pass rate ("-" before it is known) as `domain=weight/rate`, heaviest
    first, wrapped at `width` (an entry is never split)."""
    import textwrap

    weights = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("mix_weight/")}
    if not weights:
        return []
    rates = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("mix_pass_rate/")}
    items = [
        f"{d}={w:.3f}/{rates[d]:.2f}" if d in rates else f"{d}={w:.3f}/-"
        for d, w in sorted(weights.items(), key=lambda kv: (-kv[1], kv[0]))
    ]
    head = f"step {step} mix (weight/pass rate): "
    return textwrap.wrap(head + ", ".join(items), width, subsequent_indent="  ")


def write_mix_report(history: list[dict[str, Any]], reports: str) -> dict[str, str]:
    """Per step, each domain's weight, rolling pass rate and result count: reports/
    mix.jsonl (one record a step) and mix.png (pass-rate and weight curves, when
    matplotlib is installed: `ac2_jax[viz]`). Returns the paths written."""
    import json

    records = []
    for i, m in enumerate(history):
        rec: dict[str, Any] = {"step": int(m.get("rl_step", i)) + 1}
        for key in ("mix_weight", "mix_pass_rate", "mix_results"):
            rec[key] = {k.split("/", 1)[1]: v for k, v in m.items() if k.startswith(key + "/")}
        records.append(rec)
    os.makedirs(reports, exist_ok=True)
    out = {"mix_jsonl": os.path.join(reports, "mix.jsonl")}
    with open(out["mix_jsonl"], "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return out
    from matplotlib import colormaps

    fig = Figure(figsize=(15, 5.5))
    ax_pass, ax_weight = fig.subplots(1, 2)
    domains = sorted({d for r in records for d in r["mix_weight"]})
    # 40 distinct colours, then line styles: every domain its own line.
    colours = [colormaps[m](i) for m in ("tab20", "tab20b") for i in range(20)]
    for i, d in enumerate(domains):
        style = {"color": colours[i % len(colours)], "linestyle": ("-", "--", ":")[i // 40 % 3],
                 "linewidth": 1.2, "label": d}  # fmt: skip
        steps = [r["step"] for r in records if d in r["mix_pass_rate"]]
        ax_pass.plot(steps, [r["mix_pass_rate"][d] for r in records if d in r["mix_pass_rate"]],
                     **style)  # fmt: skip
        ax_weight.plot([r["step"] for r in records], [r["mix_weight"].get(d, 0.0) for r in records],
                       **style)  # fmt: skip
    ax_pass.set(title="rolling pass rate per domain", xlabel="step", ylim=(-0.02, 1.02))
    ax_weight.set(title="mix weight per domain", xlabel="step")
    ax_weight.legend(fontsize=6, ncol=2, loc="center left", bbox_to_anchor=(1.0, 0.5))
    out["mix_png"] = os.path.join(reports, "mix.png")
    fig.savefig(out["mix_png"], dpi=110, bbox_inches="tight")
    return out


def alarm_fields(m: dict[str, Any]) -> dict[str, float]:
    """The console's alarm metrics of a step (`training.rl.alarms`): drift (on-policy
    mean |delta log-prob|), weights (published versions whose served checksum matched
    so far), alarms (alarms fired so far); absent when not measured."""
    out = {}
    if "drift/onpolicy_abs_mean" in m:
        out["drift"] = m["drift/onpolicy_abs_mean"]
    if "alarms/weights_verified" in m:
        out["weights_ok"] = m["alarms/weights_verified"]
    out["alarms"] = sum(v for k, v in m.items() if k.startswith("alarms/fired/"))
    return out


def _trained_tokens(m: dict[str, Any]) -> int:
    return int(sum(v for k, v in m.items() if k.startswith("trained_tokens/")))


def _note(m: dict[str, Any]) -> str:
    """Why a step trained nothing, in words (its loss is then absent or 0)."""
    if not m.get("skipped_update"):
        return ""
    attempts = int(m.get("traces", 0))
    errors = int(m.get("agent_errors", 0) + m.get("infra_errors", 0))
    if attempts and errors == attempts:
        why = "every attempt ended in an error"
    elif _trained_tokens(m) == 0 and m.get("truncated_agent_tokens"):
        why = "every trained token was cut"
    elif _trained_tokens(m) == 0:
        why = "no attempt kept a trained token"
    elif m.get("zero_advantage_groups"):
        why = "every group's rewards tied"
    else:
        why = "no trace carried a signal"
    return f"(no update: {why})"


def _step_lines(m: dict[str, Any], traces, cfg: RLRecipeConfig) -> list[str]:
    """What the console says of a step beyond its progress line: the trained tokens cut
    (rows too short for the traces) and the attempts that ended in an error."""
    step, lines = int(m.get("rl_step", 0)) + 1, []
    cut = int(m.get("truncated_agent_tokens", 0))
    if cut:
        batch = cfg.rl.batch
        limit = (
            f"rl.batch.max_seq_len={batch.max_seq_len}"
            if batch.max_seq_len
            else f"4 x rl.batch.seq_len={4 * batch.seq_len}"
        )
        lines.append(
            f"step {step}: {cut} of {cut + _trained_tokens(m)} trained tokens cut: rows end at "
            f"{limit}; raise rl.batch.max_seq_len"
        )
    return lines + error_lines(step, traces)


async def arl(
    model: Any, env: Any, config: RLRecipeConfig | None = None, *, harness=None
) -> RecipeResult:
    """`rl` inside a running event loop. harness: `(sampling, max_steps) -> orchestrator
    factory`, for callers whose harness needs more than the env (default:
    `harness_factory`: the env's make_harness or the tool loop)."""
    import ac2_jax.serving  # noqa: F401 - the endpoint's extras, checked before any work
    from ac2_jax.trace import TraceStore
    from ac2_jax.training.rl.trainer import EndpointCollector, RLTrainer

    cfg = config if config is not None else RLRecipeConfig()
    paths = cfg.paths.resolved()
    resume_at, changed = claim_workdir("rl", cfg, model)  # before any work
    # A mesh above the device count, or rows it cannot split (rows grow in steps of
    # rows_multiple): refused now.
    rows = {"rl.batch.rows_multiple": cfg.rl.batch.rows_multiple}
    mesh, mesh_line = recipe_mesh(cfg.mesh, rows, cfg.rl.grad_accum)
    env = _mixed(check_env(load_env(env), "rl"), cfg)
    spec = model
    model, tokenizer = load_model(
        model, paths.workdir, lora=cfg.lora, seed=cfg.seed, tool_parser=cfg.tool_parser
    )
    check_model(cfg, "rl", model, spec, resume_at)
    write_json(os.path.join(paths.reports, "config.json"), cfg)
    rl_cfg = cfg.rl
    progress = Progress("rl", rl_cfg.steps, enabled=cfg.log.progress)
    progress.say(f"env {type(env).__name__}, workdir {paths.workdir}")
    progress.say(tool_parser_line(tokenizer))
    if mesh_line:
        progress.say(mesh_line)
    if isinstance(env, DomainMixer):
        _audit_domains(env, paths.reports, progress)
    if resume_at:
        progress.say(resuming_line(resume_at, changed))
    t_start = time.perf_counter()
    async with serve_policy(
        model, tokenizer, publish_dir=paths.publish, traces_dir=paths.traces,
        sampler=cfg.sampler, rollout=cfg.rollout, max_batch=rl_cfg.concurrency, seed=cfg.seed,
    ) as (sampler, lifecycle):  # fmt: skip
        before = await eval_before(cfg, env, lifecycle, progress, resume_at, harness)
        sampling = {"temperature": cfg.rollout.temperature, "max_tokens": cfg.rollout.max_tokens}
        store = TraceStore(os.path.join(paths.traces, "rollouts.jsonl"))
        make = (harness or harness_factory)(sampling, cfg.rollout.max_steps)
        collector = EndpointCollector(
            lifecycle, env, make, cfg.sampler.model_name, store,
            tasks_per_step=rl_cfg.tasks_per_step, attempts_per_task=rl_cfg.attempts_per_task,
            seed=cfg.seed + 1, concurrency=rl_cfg.concurrency,
            infra_retries=cfg.rollout.infra_retries, rollout_deadline_s=cfg.rollout.deadline_s,
            infra_backoff_s=cfg.rollout.infra_backoff_s,
            infra_backoff_max_s=cfg.rollout.infra_backoff_max_s,
        )  # fmt: skip
        # In memory the sampler takes each update itself: a reload of its publish
        # (on_publish) would load the same weights again, from disk.
        in_memory = hands_off_in_memory(cfg.sampler, sampler)
        trainer = RLTrainer(
            model, collector, rl_cfg, os.path.join(paths.workdir, "rl"),
            publish_dir=paths.publish, mesh=mesh,
            on_publish=None if in_memory else sampler.load_weights,
            logger=metrics_logger(paths.metrics, cfg.log),
            sampler_counters=getattr(sampler, "counters", None),  # the embedded sampler's
            tokenizer=tokenizer,  # replays the masks of grammar-constrained completions
            alarms=cfg.alarms, served_weights=getattr(sampler, "served_weights", None),
            hand_off=sampler.set_params if in_memory else None,
        )  # fmt: skip

        def on_progress(steps_done: int, version: int) -> None:
            if trainer.history and steps_done > trainer.start_step:
                m = trainer.history[-1]
                # The PPO surrogate's value is ~0 on-policy by construction (ratio 1,
                # advantages of mean 0): grad_norm shows the update, loss is left out.
                keys = ("pass_rate", "reward_mean", "grad_norm", "kl_to_sampler")
                shown = {k: m[k] for k in keys if k in m}
                shown.update(alarm_fields(m))
                progress.step(steps_done, shown, _note(m))
                for line in _step_lines(m, trainer.last_traces, cfg):
                    progress.say(line)
                for line in mix_lines(int(m.get("rl_step", 0)) + 1, m):
                    progress.say(line)
                stop = setting_failure(
                    "rl", int(m.get("rl_step", 0)) + 1, trainer.last_traces, cfg, model
                )
                if stop is not None:
                    raise ConfigError(stop)

        trainer.on_progress = on_progress
        progress.start(trainer.start_step)
        try:
            history = await trainer.run()
            final = trainer.model()
        finally:
            trainer.close()
        after = await evaluate_policy(cfg, env, lifecycle, "after", progress, harness)
    if trainer.mixer is not None:
        report_mix = write_mix_report(history, paths.reports)
    else:
        report_mix = {}
    export = os.path.join(paths.reports, "final_hf")
    exported = export_model(final, tokenizer, export)
    report: dict[str, Any] = {
        "recipe": "rl",
        "steps": len(history),  # this invocation's; run_report makes it the run's
        "final_pass_rate": history[-1].get("pass_rate") if history else None,
        **exported,  # hf_export (and adapter: PEFT's format, for a LoRA run)
        "published": paths.publish,
        "time_s": time.perf_counter() - t_start,
        **report_mix,  # mix_jsonl, mix_png: an adaptive mix's curves
    }
    if before is not None and after is not None:
        from ac2_jax.evals import compare_results

        diff = compare_results(after, before, "pass").estimate
        report["eval"] = {
            "before": before.pass_rate.mean,
            "before_step": 0,  # the base model's, kept from the run's start
            "after": after.pass_rate.mean,
            "improvement": {"mean": diff.mean, "ci95": [diff.low, diff.high]},
        }
    report = run_report(paths, report, resume_at)
    if cfg.log.report_files:
        report["learning_curve"] = write_learning_curve(paths, "rl")
        report["pages"] = write_trace_pages(paths, trainer.last_traces or [], tokenizer)
    write_json(os.path.join(paths.reports, "report.json"), report)
    progress.say(f"done in {report['time_s']:.0f}s; report {paths.reports}/report.json")
    evals = {k: v for k, v in (("before", before), ("after", after)) if v is not None}
    return RecipeResult(report, final, evals, store)


def rl(model: Any, env: Any, config: RLRecipeConfig | None = None) -> RecipeResult:
    """Trains `model` (an HF directory, a preset name or a (model, tokenizer) pair)
    by task-level RL on `env` (an Env, a factory, or "pkg.module:Factory").
    Returns a RecipeResult (its report also in paths.reports/report.json)."""
    return run_sync(arl(model, env, config), "rl")
