"""The SFT recipe: supervised fine-tuning on demonstrations of an environment's tasks.

    report = recipes.sft("path/to/hf_model", "my_pkg.envs:MyEnv", recipes.SFTRecipeConfig())

The data is `demos.num_tasks` train tasks, each solved by the env's
`demonstration(task)` (an OpenAI-format chat, tool calls included), or the
chats of a JSONL `demos.file` (`{"messages": [...], "tools": [...]}` per
line; then no env is needed). The loss is on the assistant turns. The run
checkpoints (`sft.checkpoint_every`) and resumes when asked (`--resume`); metrics go to
metrics.jsonl and TensorBoard; the model is exported in HF format.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ac2_jax.config import ConfigError
from ac2_jax.envs.contract import EnvError, check_env, demonstration_problems, load_env
from ac2_jax.recipes.common import (
    Progress,
    RecipeResult,
    check_model,
    claim_workdir,
    export_model,
    load_model,
    metrics_logger,
    recipe_mesh,
    resuming_line,
    run_report,
    tool_parser_line,
    write_demo_pages,
    write_json,
    write_learning_curve,
)
from ac2_jax.recipes.config import SFTRecipeConfig

__all__ = ["demo_chats", "sft"]


def _check_demos(segments, problems: list[str], cfg: SFTRecipeConfig) -> None:
    """Refuses, in one line, demonstrations with problems (`demonstration_problems`, a
    tool-call parser that does not read their calls back) or longer than sft.seq_len
    (unless sft.truncate cuts and counts them)."""
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise EnvError(
            f"{len(problems)} problems in the {len(segments)} demonstrations: "
            f"{'; '.join(problems[:3])}{more}; fix the demonstrations (or tool_parser: the "
            "model's tool-call format) so that the model is trained on what it can do"
        )
    long = [len(s) for s in segments if len(s) > cfg.sft.seq_len]
    if long and not cfg.sft.truncate:
        raise ConfigError(
            f"{len(long)} of {len(segments)} demonstrations are longer than "
            f"sft.seq_len={cfg.sft.seq_len} (the longest: {max(long)} tokens); raise "
            f"sft.seq_len to at least {max(long)}, or set sft.truncate=true to cut them "
            "(the cut tokens are counted)"
        )


def demo_chats(
    env, config: SFTRecipeConfig, problems: list[str] | None = None
) -> list[tuple[str, list[dict], list[dict] | None]]:
    """(task id, messages, tools) of every demonstration the config names; with a
    `problems` list, each env demonstration's `demonstration_problems` go there."""
    demos = config.demos
    if demos.file:
        out = []
        with open(demos.file) as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    messages = row["messages"]
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(
                        f"demos.file {demos.file} line {i + 1}: expected "
                        f'{{"messages": [...], "tools": [...]?}} ({e!r})'
                    ) from None
                out.append((str(row.get("task", f"demo-{i}")), messages, row.get("tools")))
        return out
    tools = [t.spec() for t in env.tools] or None
    tasks = env.sample_tasks(demos.num_tasks, seed=config.seed, split="train")
    chats = [(t.task_id, env.demonstration(t), tools) for t in tasks]
    if problems is not None:
        for t, (_, messages, _) in zip(tasks, chats, strict=True):
            problems += demonstration_problems(env, t, messages)
    return chats


def sft(model: Any, env: Any = None, config: SFTRecipeConfig | None = None) -> RecipeResult:
    """Fine-tunes `model` (HF directory, preset name, or (model, tokenizer)) on the
    demonstrations of `env` (or of `config.demos.file`); returns a RecipeResult."""
    from ac2_jax.training import run_sft
    from ac2_jax.training.sft.demos import demo_segment

    cfg = config if config is not None else SFTRecipeConfig()
    paths = cfg.paths.resolved()
    resume_at, changed = claim_workdir("sft", cfg, model)  # before any work
    # A mesh above the device count, or rows it cannot split: refused now.
    mesh, mesh_line = recipe_mesh(
        cfg.mesh, {"sft.batch_rows": cfg.sft.batch_rows}, cfg.sft.grad_accum
    )
    if not cfg.demos.file:
        if env is None:
            raise ValueError("sft: give an env (--env) or a demos.file of chats")
        env = check_env(load_env(env), "sft")
    spec = model
    model, tokenizer = load_model(
        model, paths.workdir, lora=cfg.lora, seed=cfg.seed, tool_parser=cfg.tool_parser
    )
    t_start = time.perf_counter()
    problems: list[str] = []  # every demonstration checked before any write
    chats = demo_chats(env, cfg, problems)
    segments = [
        demo_segment(tokenizer, messages, tools, task=task, problems=problems)
        for task, messages, tools in chats
    ]
    _check_demos(segments, problems, cfg)
    check_model(cfg, "sft", model, spec, resume_at)
    write_json(os.path.join(paths.reports, "config.json"), cfg)
    progress = Progress("sft", cfg.sft.steps, enabled=cfg.log.progress)
    progress.say(f"{len(segments)} demonstrations, workdir {paths.workdir}")
    progress.say(tool_parser_line(tokenizer))
    if mesh_line:
        progress.say(mesh_line)
    if resume_at:
        progress.say(resuming_line(resume_at, changed))
    every = max(1, cfg.sft.steps // 20)
    logger = metrics_logger(paths.metrics, cfg.log)

    def log(step: int, m: dict) -> None:
        if step % every == 0 or step == cfg.sft.steps:
            progress.step(step, {k: m[k] for k in ("loss", "grad_norm") if k in m})

    try:
        result = run_sft(
            model, segments, cfg.sft, cfg.optimizer, workdir=os.path.join(paths.workdir, "sft"),
            log=log, logger=logger, mesh=mesh,
        )  # fmt: skip
    finally:
        logger.close()
    export = os.path.join(paths.reports, "final_hf")
    final: Any = result.model()
    exported = export_model(final, tokenizer, export)
    history = result.history
    report: dict[str, Any] = {
        "recipe": "sft",
        "steps": len(history),
        "demonstrations": len(segments),
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        **exported,  # hf_export (and adapter: PEFT's format, for a LoRA run)
        "time_s": time.perf_counter() - t_start,
    }
    report = run_report(paths, report, resume_at, keep_first=("first_loss",))
    if cfg.log.report_files:
        report["learning_curve"] = write_learning_curve(paths, "sft")
        report["pages"] = write_demo_pages(paths, chats)
    write_json(os.path.join(paths.reports, "report.json"), report)
    progress.say(f"done in {report['time_s']:.0f}s; report {paths.reports}/report.json")
    return RecipeResult(report, final)
