"""Evaluate checkpoints: K attempts per task through the served policy, with intervals.

    python -m experiments.calculator.evaluate --config=experiments/calculator/eval_config.py
    python -m experiments.calculator.evaluate --config=experiments/calculator/eval_config.py:toy \
        --config.workdir=/tmp/evals

Each checkpoint is loaded (Orbax, `ac2_jax.models.io.params_io`), published to
an in-process JaxSampler behind the endpoint (real HTTP, as in the demo),
and evaluated with `ac2_jax.evals.evaluate` on the same tasks and seeds.
Writes workdir/report.json, report.html and PNG plots; prints a table.
`run(cfg)` returns the report dict.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import time

from absl import app
from absl import logging as absl_logging
from ml_collections import config_flags

from ac2_jax.envs import CalculatorEnv, DomainMixer, StepwiseCalculatorEnv
from ac2_jax.evals import EvalResult, TokenPrices, compare_results, evaluate
from ac2_jax.models.io.params_io import (
    load_published,
    publish_weights,
    published_steps,
    restore_params,
)
from ac2_jax.orchestration import LifecycleClient
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.serving.app import build_app
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.text import Tokenizer
from experiments.calculator import agent as calculator_agent
from experiments.calculator import eval_report

MODEL_NAME = "ac2-eval"
DOMAINS = {"calculator": lambda cfg: CalculatorEnv(num_range=tuple(cfg.env.num_range),
                                                   answer_digits=cfg.env.answer_digits),
           "stepwise_calculator": lambda cfg: StepwiseCalculatorEnv()}


def build_env(cfg) -> DomainMixer:
    """The configured domains (cfg.env.domains), each its own env, in one mixer."""
    unknown = [d for d in cfg.env.domains if d not in DOMAINS]
    if unknown or not cfg.env.domains:
        raise ValueError(f"env.domains: unknown or empty {list(cfg.env.domains)}; "
                         f"choose from {sorted(DOMAINS)}")
    return DomainMixer({d: DOMAINS[d](cfg) for d in cfg.env.domains})


def eval_tasks(cfg, env: DomainMixer) -> list:
    """eval.num_tasks tasks of each domain (ids "<domain>/...")."""
    out = []
    for name, sub in env.envs.items():
        out += DomainMixer({name: sub}).sample_tasks(cfg.eval.num_tasks, cfg.eval.seed,
                                                      cfg.eval.split)
    return out


def parse_checkpoints(entries) -> list[dict]:
    """[{"name", "path", "step"}]: "dir" or "dir@STEP" (a published step); none: the
    initialized model. Every path must exist (checked before any work)."""
    if not entries:
        return [{"name": "init", "path": None, "step": None}]
    out, names = [], set()
    for entry in entries:
        path, _, step = str(entry).partition("@")
        if step and not step.isdigit():
            raise ValueError(f"checkpoints: {entry!r}: the part after '@' must be a step number")
        path = os.path.abspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoints: no directory {path} (from {entry!r}); run "
                                    "scripts/demo.sh first or set --config.checkpoints")
        name = os.path.basename(path.rstrip("/")) + (f"@{step}" if step else "")
        while name in names:
            name += "'"
        names.add(name)
        out.append({"name": name, "path": path, "step": int(step) if step else None})
    return out


def load_checkpoint(model, ckpt: dict) -> int | None:
    """Loads `ckpt` into `model` in place; returns the published step read (or None)."""
    if ckpt["path"] is None:
        return None
    if published_steps(ckpt["path"]):
        return load_published(model, ckpt["path"], ckpt["step"])
    if ckpt["step"] is not None:
        raise ValueError(f"checkpoints: {ckpt['path']} is not a published-weights directory, "
                         "so '@STEP' does not apply")
    restore_params(model, ckpt["path"])
    return None


def tokenizer_for(cfg, workdir: str, env: DomainMixer):
    if cfg.tokenizer.path:
        if not os.path.isdir(cfg.tokenizer.path):
            raise FileNotFoundError(f"tokenizer.path: no directory {cfg.tokenizer.path}; set "
                                    "it to the run's tokenizer, or None to build one")
        return Tokenizer.from_pretrained(cfg.tokenizer.path)
    calc = env.envs.get("calculator") or CalculatorEnv()
    return calculator_agent.build_tokenizer(cfg, os.path.join(workdir, "tokenizer"), calc)


def _progress(enabled: bool):
    """A rich progress bar (or None when disabled)."""
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.progress import Progress
    return Progress()


async def _pipeline(cfg, log=print) -> dict:
    t_start = time.perf_counter()
    workdir = os.path.abspath(cfg.workdir)
    os.makedirs(workdir, exist_ok=True)
    ckpts = parse_checkpoints(cfg.checkpoints)
    prices = TokenPrices(cfg.prices.cached_input, cfg.prices.uncached_input, cfg.prices.output)
    env = build_env(cfg)
    tasks = eval_tasks(cfg, env)
    tokenizer = tokenizer_for(cfg, workdir, env)
    model = calculator_agent.build_model(cfg, tokenizer.vocab_size)
    stage = calculator_agent.build_model(cfg, tokenizer.vocab_size)
    publish_dir = os.path.join(workdir, "published")
    eos = [i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None]
    sampler = JaxSampler(model, publish_dir=publish_dir,
                         max_context=cfg.model.max_position_embeddings,
                         max_batch=cfg.eval.concurrency, eos_token_ids=eos, tokenizer=tokenizer,
                         seed=cfg.seed, fixed_shapes=cfg.sampler.fixed_shapes)
    admin_key = secrets.token_hex(16)
    base_url, stop = serve_in_thread(build_app(sampler, tokenizer, admin_key=admin_key,
                                               model_name=MODEL_NAME))
    lifecycle = LifecycleClient(base_url, admin_key)
    make = calculator_agent.orchestrator_factory(
        {"temperature": cfg.eval.temperature, "max_tokens": cfg.eval.max_tokens},
        cfg.eval.max_steps)
    e = cfg.eval
    results: list[EvalResult] = []
    total = len(ckpts) * len(tasks) * e.k
    try:
        with _progress(cfg.report.progress) as bar:
            job = bar.add_task("eval attempts", total=total) if bar is not None else None
            for i, ckpt in enumerate(ckpts):
                ckpt["loaded_step"] = load_checkpoint(stage, ckpt)
                ckpt["policy_version"] = i + 1  # the version the sampler serves it as
                publish_weights(stage, publish_dir, i + 1, keep=2)
                sampler.load_weights(i + 1)
                res = await evaluate(
                    lifecycle, env, tasks, make, MODEL_NAME, name=ckpt["name"], k=e.k,
                    concurrency=e.concurrency, seed=e.seed, level=e.level, prices=prices,
                    pass_threshold=e.pass_threshold, infra_error=e.infra_error,
                    infra_retries=e.infra_retries, timeout_s=e.timeout_s,
                    on_attempt=(lambda _r: bar.advance(job)) if bar is not None else None)
                served = sorted({c.policy_version for t in res.traces for ep in t.episodes
                                 for c in ep.completions})
                ckpt["served_policy_versions"] = served
                results.append(res)
                log(f"{ckpt['name']}: pass rate {res.pass_rate}")
    finally:
        await lifecycle.aclose()
        stop()
        sampler.close()

    comparisons = [(r.name, results[0].name, compare_results(r, results[0], "pass"))
                   for r in results[1:]]
    report = {"config": json.loads(cfg.to_json_best_effort()),
              "checkpoints": [{**c, "result": r.to_dict()} for c, r in zip(ckpts, results)],
              "comparisons": [{"after": a, "before": b, **c.to_dict()}
                              for a, b, c in comparisons],
              "time_s": time.perf_counter() - t_start}
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(report, f, indent=2, allow_nan=False)
    plots = eval_report.write_plots(results, workdir)
    eval_report.write_html(report, results, comparisons, plots,
                           os.path.join(workdir, "report.html"),
                           max_task_rows=cfg.report.max_task_rows)
    eval_report.print_table(results)
    return report


def run(cfg, log=print) -> dict:
    return asyncio.run(_pipeline(cfg, log))


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)   # Orbax logs every save at INFO
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request
    cfg = _CONFIG.value
    run(cfg)
    print(f"report: {os.path.abspath(cfg.workdir)}/report.html")


if __name__ == "__main__":
    # Defined here, not at import: importing this module (tests) defines no absl flag.
    _CONFIG = config_flags.DEFINE_config_file("config", "experiments/calculator/eval_config.py")
    app.run(main)
