"""The eval recipe: a model on an environment's held-out tasks, with confidence intervals.

    report = recipes.eval_model("runs/mine/report/final_hf", "my_pkg.envs:MyEnv",
                                recipes.EvalRecipeConfig())
    python -m ac2_jax.train --recipe=eval --env=my_pkg.envs:MyEnv --model=DIR \
        --config.eval.num_tasks=64 --config.eval.attempts=4

`eval.num_tasks` tasks of the env's "eval" split, `eval.attempts` attempts each,
run through the endpoint (the env's harness or the tool loop) as training's
evals are (`evals.evaluate`: the same tasks and seeds for the same `seed`, so two
models' reports pair). Nothing trains and no workdir is claimed: the run writes
only its own eval_* files, replacing those of an earlier eval there (a training
run's files stay): eval_report.json (pass rate and its 95% CI, the summary),
eval_config.json, eval_attempts.json (every attempt) and, with
`log.report_files`, eval_trace_<i>.html in the report folder (an earlier eval's
pages are removed first, so none is left stale), and the served traces in
traces/eval_served.jsonl (not the training run's served.jsonl).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from ac2_jax._sync import run_sync
from ac2_jax.config import ConfigError
from ac2_jax.envs.contract import check_env, load_env
from ac2_jax.recipes._rl import evaluate_policy
from ac2_jax.recipes.common import (
    Progress,
    RecipeResult,
    load_model,
    remove_pages,
    serve_policy,
    tool_parser_line,
    write_json,
    write_trace_pages,
)
from ac2_jax.recipes.config import (
    EvalConfig,
    LogConfig,
    PathsConfig,
    RolloutConfig,
    SamplerConfig,
)

__all__ = ["EvalRecipeConfig", "aeval_model", "eval_model"]

SERVED = "eval_served.jsonl"  # the eval's own trace store, in paths.traces
PAGES = "eval_trace"  # its trace pages: paths.reports/eval_trace_<i>.html


@dataclasses.dataclass(frozen=True)
class EvalRecipeConfig:
    seed: int = 0  # seeds the tasks and each attempt's sampling: two models' reports pair
    paths: PathsConfig = PathsConfig()
    rollout: RolloutConfig = RolloutConfig()
    sampler: SamplerConfig = SamplerConfig()
    eval: EvalConfig = EvalConfig(num_tasks=32)
    log: LogConfig = LogConfig()
    # The model's tool-call format (text.tool_parsers: hermes, llama3_json, mistral,
    # qwen3_coder, gemma_tool_code); None: its chat template's, else its family's.
    tool_parser: str | None = None


async def aeval_model(model: Any, env: Any, config: EvalRecipeConfig | None = None) -> RecipeResult:
    """`eval_model` inside a running event loop."""
    import ac2_jax.serving  # noqa: F401 - the endpoint's extras, checked before any work

    cfg = config if config is not None else EvalRecipeConfig()
    if cfg.eval.num_tasks < 1 or cfg.eval.attempts < 1:
        raise ConfigError(
            f"--recipe=eval needs eval.num_tasks >= 1 and eval.attempts >= 1 (got "
            f"{cfg.eval.num_tasks}, {cfg.eval.attempts})"
        )
    if cfg.paths.existing != "refuse":
        raise ConfigError(
            "--recipe=eval claims no workdir (it trains nothing and replaces only its own "
            f"eval_* files): drop --resume / --overwrite (paths.existing={cfg.paths.existing!r})"
        )
    paths = cfg.paths.resolved()
    env = check_env(load_env(env), "rl")  # tasks and a verifier, as RL needs
    spec = model
    model, tokenizer = load_model(model, paths.workdir, seed=cfg.seed, tool_parser=cfg.tool_parser)
    progress = Progress("eval", 1, enabled=cfg.log.progress)
    progress.say(f"env {type(env).__name__}, workdir {paths.workdir}")
    progress.say(tool_parser_line(tokenizer))
    t0 = time.perf_counter()
    served = os.path.join(paths.traces, SERVED)
    if os.path.exists(served):  # an earlier eval's: this eval's file holds its own only
        os.remove(served)
    async with serve_policy(
        model, tokenizer, publish_dir=paths.publish, traces_dir=paths.traces,
        sampler=cfg.sampler, rollout=cfg.rollout, max_batch=cfg.eval.concurrency, seed=cfg.seed,
        trace_file=SERVED,
    ) as (_, lifecycle):  # fmt: skip
        result = await evaluate_policy(cfg, env, lifecycle, "held-out", progress)
    rate = result.pass_rate
    full = result.to_dict()
    report: dict[str, Any] = {
        "recipe": "eval",
        "model": str(spec) if isinstance(spec, (str, os.PathLike)) else None,
        "env": type(env).__name__,
        "tasks": len(result.task_ids),
        "attempts": result.k,
        "pass_rate": rate.mean,
        "pass_rate_ci95": [rate.low, rate.high],
        "summary": full["summary"],
        "time_s": time.perf_counter() - t0,
    }
    progress.say(
        f"pass rate {rate.mean:.3f} [95% CI {rate.low:.3f}, {rate.high:.3f}] over "
        f"{len(result.task_ids)} tasks x {result.k}"
    )
    report["served_traces"] = served
    remove_pages(paths.reports, PAGES)  # an earlier eval's pages, so none is left stale
    write_json(os.path.join(paths.reports, "eval_attempts.json"), full["attempts"])
    write_json(os.path.join(paths.reports, "eval_config.json"), cfg)
    if cfg.log.report_files:
        report["pages"] = write_trace_pages(paths, result.traces, tokenizer, name=PAGES)
    write_json(os.path.join(paths.reports, "eval_report.json"), report)
    progress.say(f"report {paths.reports}/eval_report.json")
    return RecipeResult(report, model, {"eval": result})


def eval_model(model: Any, env: Any, config: EvalRecipeConfig | None = None) -> RecipeResult:
    """Evaluates `model` (an HF directory, a preset name or a (model, tokenizer) pair)
    on `env`'s held-out tasks; returns a RecipeResult (its report also in
    paths.reports/eval_report.json, its EvalResult as evals["eval"])."""
    return run_sync(aeval_model(model, env, config), "eval_model")
