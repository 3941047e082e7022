"""The distillation recipe: on-policy self-distillation (OPSD, RMSD) from hints.

    report = recipes.distill("path/to/hf_model", "my_pkg.envs:MyEnv",
                             recipes.DistillRecipeConfig())

Each step rolls `loop.tasks_per_step` train tasks out `loop.attempts_per_task`
times through the endpoint with the current policy (the student), attaches
each task's hint (`env.hint(task)`) to its traces, and distills every
completion of every episode (with `loop.only_failures`, of the failed
attempts only) from the hinted teacher (`examples_from_traces`,
`SelfDistiller`: `distill.method` "opsd", "rmsd" with a rule judge, or
"sft"). With `distill.teacher` naming a model (an HF directory or a preset of
the student's vocabulary, checked before any work) the teacher is that model,
loaded once and frozen (`distill.teacher_dtype` "bfloat16" halves it): on-policy
distillation from another model; it reads the hint too unless `loop.hints` is
false (plain OPD: the teacher reads the student's prompt, and the env needs no
`hint`). The new weights are published and served for the next step. Traces
that cannot be taught are skipped whole and counted (`skipped_traces`,
`skipped/<reason>` in the step's metrics); a step with no example makes no
update and says so.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from ac2_jax._sync import run_sync
from ac2_jax.config import ConfigError
from ac2_jax.envs.contract import check_env, load_env
from ac2_jax.recipes._rl import eval_before, evaluate_policy
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
from ac2_jax.recipes.config import DistillRecipeConfig

__all__ = ["adistill", "distill", "load_teacher"]


def _judge(name: str):
    from ac2_jax.envs import RuleJudge

    if name == "keywords":
        return RuleJudge(use_hint_keywords=True)
    if name == "diff":
        return RuleJudge(use_hint_keywords=False, diff=True)
    raise ValueError(f"loop.judge must be 'keywords' or 'diff', got {name!r}")


def load_teacher(cfg: DistillRecipeConfig, tokenizer: Any, student: Any, workdir: str):
    """The `TeacherModel` `cfg.distill.teacher` names (None: the self-teacher), its
    vocabulary checked against the student's (`check_vocabulary`: one line naming
    what differs)."""
    from ac2_jax.training.distill import TeacherModel, check_vocabulary

    if not cfg.distill.teacher_is_model:
        return None
    name = cfg.distill.teacher
    model, teacher_tokenizer = load_model(name, workdir)
    check_vocabulary(
        tokenizer, teacher_tokenizer, student.config.vocab_size, model.config.vocab_size, name
    )
    return TeacherModel.from_model(
        model, teacher_tokenizer, dtype=cfg.distill.teacher_dtype, name=name
    )


def _heatmap(dist, examples, tokenizer, paths, progress: Progress) -> str | None:
    """paths.reports/distill_report.html: the teacher-student divergence per response
    token of the first of `examples` (the last step's), at the final weights, with the
    run's curves (`viz.write_distill_report`; RMSD's kept candidates and judge picks
    from the step). None (and a console line) when there is none to draw: no example,
    method "sft" (no teacher), or a separate teacher model."""
    import numpy as np

    from ac2_jax.training.distill import TeacherModel
    from ac2_jax.training.distill.data import pack_pairs
    from ac2_jax.training.distill.loss import relevance_scores, teacher_extras
    from ac2_jax.viz import write_distill_report

    cfg = dist.config
    teacher = dist.current_teacher_params()
    why = (
        "no example in the last step" if not examples
        else "method 'sft' has no teacher" if cfg.method == "sft"
        else "a separate teacher model" if isinstance(teacher, TeacherModel)
        else ""
    )  # fmt: skip
    if why:
        progress.say(f"no distillation heatmap: {why}")
        return None
    ex = examples[0]
    paired = pack_pairs([ex], cfg.seq_len, min_rows=cfg.rows, min_capacity=cfg.groups)
    div, _ = relevance_scores(
        dist.graphdef, dist.state.params, teacher, dist.state.rest, paired.student,
        teacher_extras(paired), cfg.loss(),
    )  # fmt: skip
    r, c, _, n = paired.spans[0]
    rel = dist.last_relevance  # RMSD: the step's candidates and judge picks
    cands = list(rel.candidates[0]) if rel is not None and rel.candidates else []
    picked = list(rel.selected[0]) if rel is not None and rel.selected else []
    path = os.path.join(paths.reports, "distill_report.html")
    write_distill_report(
        path, prompt=tokenizer.decode(ex.student_prompt), hint=ex.hint,
        teacher_prompt=tokenizer.decode(ex.teacher_prompt),
        response_tokens=[tokenizer.decode([t]) for t in ex.response],
        divergence=[float(x) for x in np.asarray(div)[r, c : c + n]],
        candidates=cands, selected=picked,
        info={"method": cfg.method, "kind": cfg.kind, "example": "the last step's first"},
        title=f"Distillation report ({cfg.method})",
    )  # fmt: skip
    return path


async def adistill(model: Any, env: Any, config: DistillRecipeConfig | None = None) -> RecipeResult:
    """`distill` inside a running event loop."""
    import ac2_jax.serving  # noqa: F401 - the endpoint's extras, checked before any work
    from ac2_jax.trace import TraceStore
    from ac2_jax.training import SelfDistiller, create_train_state, publish
    from ac2_jax.training.distill.traces import examples_from_traces
    from ac2_jax.training.rl.trainer import EndpointCollector

    cfg = config if config is not None else DistillRecipeConfig()
    paths, loop = cfg.paths.resolved(), cfg.loop
    resume_at, changed = claim_workdir("distill", cfg, model)  # before any work
    # A mesh above the device count: refused now (rows grow in steps the mesh splits).
    mesh, mesh_line = recipe_mesh(cfg.mesh)
    if not loop.hints and not cfg.distill.teacher_is_model:
        raise ConfigError(
            "loop.hints=false needs distill.teacher naming a teacher model: the self-teacher "
            f"({cfg.distill.teacher!r}) without a hint is the student itself"
        )
    env = check_env(load_env(env), "distill" if loop.hints else "rl")  # no hint(): plain OPD
    spec = model
    model, tokenizer = load_model(
        model, paths.workdir, lora=cfg.lora, seed=cfg.seed, tool_parser=cfg.tool_parser
    )
    check_model(cfg, "distill", model, spec, resume_at)
    teacher = load_teacher(cfg, tokenizer, model, paths.workdir)
    write_json(os.path.join(paths.reports, "config.json"), cfg)
    graphdef, state = create_train_state(model, cfg.optimizer, rng=cfg.seed)
    logger = metrics_logger(paths.metrics, cfg.log)
    dist = SelfDistiller(
        graphdef, state, cfg.distill, cfg.optimizer,
        judge=_judge(loop.judge) if cfg.distill.method == "rmsd" else None, tokenizer=tokenizer,
        workdir=os.path.join(paths.workdir, "distill"), logger=logger, teacher_model=teacher,
        mesh=mesh,
    )  # fmt: skip
    start = dist.restore()
    progress = Progress(f"distill:{cfg.distill.method}", loop.steps, enabled=cfg.log.progress)
    progress.say(f"env {type(env).__name__}, workdir {paths.workdir}")
    progress.say(tool_parser_line(tokenizer))
    if mesh_line:
        progress.say(mesh_line)
    if teacher is not None:
        hinted = "with the env's hints" if loop.hints else "without hints"
        progress.say(f"teacher model {teacher.name} ({hinted})")
    if start:
        progress.say(resuming_line(start, changed))
    t_start, history = time.perf_counter(), []
    last_collected: list = []  # the last step's attempts (trace pages)
    last_examples: list = []  # the last step's examples (the heatmap)
    heatmap = None
    try:
        async with serve_policy(
            model, tokenizer, publish_dir=paths.publish, traces_dir=paths.traces,
            sampler=cfg.sampler, rollout=cfg.rollout, max_batch=loop.concurrency, seed=cfg.seed,
        ) as (sampler, lifecycle):  # fmt: skip
            # SamplerConfig.hand_off: "memory" hands the embedded sampler the params
            # directly (the folder is still written); "disk" reloads the publish.
            in_memory = hands_off_in_memory(cfg.sampler, sampler)
            if start:
                publish(
                    graphdef,
                    dist.state,
                    paths.publish,
                    start,
                    keep=2,
                    sampler=sampler,
                    in_memory=in_memory,
                )
            before = await eval_before(cfg, env, lifecycle, progress, start)
            sampling = {
                "temperature": cfg.rollout.temperature,
                "max_tokens": cfg.rollout.max_tokens,
            }
            collector = EndpointCollector(
                lifecycle, env, harness_factory(sampling, cfg.rollout.max_steps),
                cfg.sampler.model_name, TraceStore(os.path.join(paths.traces, "rollouts.jsonl")),
                tasks_per_step=loop.tasks_per_step, attempts_per_task=loop.attempts_per_task,
                seed=cfg.seed + 1, concurrency=loop.concurrency,
                infra_retries=cfg.rollout.infra_retries, rollout_deadline_s=cfg.rollout.deadline_s,
            )  # fmt: skip
            progress.start(start)
            for step in range(start, loop.steps):
                tasks = {t.task_id: t for t in collector.tasks(step)}
                collected = await collector.collect(step)
                stop = setting_failure("distill", step + 1, collected, cfg, model)
                if stop is not None:  # before any update: the run cannot learn so
                    for line in error_lines(step + 1, collected):
                        progress.say(line)
                    raise ConfigError(stop)
                traces = [t for t in collected if t.status != "infra_error"]
                for tr in traces:
                    hint = env.hint(tasks[tr.task_id]) if loop.hints else None
                    tr.hints = [hint] if hint else []
                # infra_error traces (our fault, retried by the collector) are never taught.
                counts: dict[str, Any] = {"infra_error_traces": len(collected) - len(traces)}
                if loop.only_failures:  # data path (c): only what the verifier failed
                    failed = [t for t in traces if t.reward is None or t.reward < loop.pass_reward]
                    counts["passed_traces"] = len(traces) - len(failed)
                    traces = failed
                examples = examples_from_traces(
                    traces, tokenizer, cfg.hint, counts=counts, unhinted=teacher is not None
                )
                m = await asyncio.to_thread(dist.update, examples)  # logs train/...
                last_collected, last_examples = collected, list(examples)
                # What the step's traces gave: examples made, traces skipped (by reason).
                logger.log(step + 1, counts, prefix="data")
                m = {**m, **{k: float(v) for k, v in counts.items()}}
                history.append(m)
                publish(
                    graphdef,
                    dist.state,
                    paths.publish,
                    step + 1,
                    keep=2,
                    sampler=sampler,
                    in_memory=in_memory,
                )
                note = "(no update: no example kept)" if m.get("skipped") else ""
                shown: dict[str, Any] = {
                    k: m[k] for k in ("loss", "kept_tokens", "examples") if k in m
                }
                progress.step(step + 1, shown, note)
                for line in error_lines(step + 1, collected):
                    progress.say(line)
            after = await evaluate_policy(cfg, env, lifecycle, "after", progress)
        dist.save()
        final = dist.state.model(graphdef)
        if cfg.log.report_files:
            heatmap = _heatmap(dist, last_examples, tokenizer, paths, progress)
    finally:
        dist.close()
    export = os.path.join(paths.reports, "final_hf")
    exported = export_model(final, tokenizer, export)
    report: dict[str, Any] = {
        "recipe": "distill",
        "method": cfg.distill.method,
        "teacher": cfg.distill.teacher,
        "steps": len(history),
        "skipped_steps": sum(1 for m in history if m.get("skipped")),
        **exported,  # hf_export (and adapter: PEFT's format, for a LoRA run)
        "time_s": time.perf_counter() - t_start,
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
    report = run_report(paths, report, start, add=("skipped_steps",))
    if cfg.log.report_files:
        report["learning_curve"] = write_learning_curve(paths, "distill")
        report["pages"] = write_trace_pages(paths, last_collected, tokenizer)
        report["heatmap"] = heatmap
    write_json(os.path.join(paths.reports, "report.json"), report)
    progress.say(f"done in {report['time_s']:.0f}s; report {paths.reports}/report.json")
    evals = {k: v for k, v in (("before", before), ("after", after)) if v is not None}
    return RecipeResult(report, final, evals, collector.store)


def distill(model: Any, env: Any, config: DistillRecipeConfig | None = None) -> RecipeResult:
    """Self-distills `model` on `env`'s hinted tasks; returns a RecipeResult."""
    return run_sync(adistill(model, env, config), "distill")
