"""The main job, end to end: SFT warm start -> eval -> task-level RL -> eval -> report.

Every rollout goes through the production path: an OpenAI client with a
rollout key -> the endpoint (FastAPI, real HTTP on 127.0.0.1) -> the
embedded JaxSampler; the learner publishes Orbax weights after each update
and the sampler reloads them. `run(config)` returns the report dict.

The config picks the env (`env.kind`: "calculator", or "chain" for the
long-horizon ChainCalculatorEnv) and the harness (`harness.kind`: "default",
or "compaction" for the compacting agent of `experiments/calculator/long_horizon.py`,
whose demonstrations are recorded through the real orchestrator and whose
report adds per-agent figures: memo fidelity, compactions, episodes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import time

import jax
from flax import nnx

from ac2_jax.config import from_config
from ac2_jax.envs import CalculatorEnv, chain_policy, demonstration
from ac2_jax.models import Decoder
from ac2_jax.models.family import get_family
from ac2_jax.models.io.params_io import restore_params, save_params
from ac2_jax.models.lora import LoRAConfig
from ac2_jax.recipes import (
    EvalConfig,
    PathsConfig,
    RLRecipeConfig,
    RolloutConfig,
    SamplerConfig,
    arl,
)
from ac2_jax.recipes.common import harness_factory, serve_policy
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.trace import TraceStore
from ac2_jax.training import OptimizerConfig, SFTConfig, run_sft
from ac2_jax.training.core.metrics_log import MetricsLogger, read_metrics
from ac2_jax.training.rl.trainer import EndpointCollector, RLConfig, RLTrainer
from ac2_jax.training.sft.demos import demo_segment

MODEL_NAME = "ac2-calculator"


# Imported on first use: the long variants' modules (openai), the evals (scipy) and the
# plots (matplotlib) cost about 2 CPU s of start-up that the default variant's processes
# (the split job's collector and learner, restarted many times in the fault harness)
# never use.
def _long_horizon():
    from experiments.calculator import long_horizon

    return long_horizon


def _subagent_helper():
    from experiments.calculator import subagent_helper

    return subagent_helper


def _evals():
    import ac2_jax.evals

    return ac2_jax.evals


def typed_configs(cfg) -> dict:
    """The config's dataclass sections (sft, sft_optimizer, rl), converted up front:
    a key that does not fit its dataclass fails here, named, before any work."""
    return {"sft": from_config(SFTConfig, cfg.sft, path="sft"),
            "sft_optimizer": from_config(OptimizerConfig, cfg.sft_optimizer, path="sft_optimizer"),
            "rl": from_config(RLConfig, cfg.rl, path="rl")}


def harness_kind(cfg) -> str:
    return "default" if cfg.get("harness") is None else cfg.harness.kind


def is_long(cfg) -> bool:
    """The long-horizon variants: a multi-agent harness ("compaction": the compacting
    agent of `long_horizon`; "subagent": the delegating agent of `subagent_helper`)
    whose demonstrations are recorded through the real orchestrator."""
    return harness_kind(cfg) in ("compaction", "subagent")


def demo_policy(cfg, rng: random.Random):
    """The scripted demonstrator of a long variant: policy(agent, messages, tools)."""
    if harness_kind(cfg) == "subagent":
        return _subagent_helper().demo_policy(cfg, rng)
    return _long_horizon().compaction_policy(cfg, rng)


def judged_key(cfg) -> str:
    """The harness event key that judges the weak link: memos, or helper answers."""
    return "helper_ok" if harness_kind(cfg) == "subagent" else "memo_ok"


def main_request_accuracy(cfg, traces, tokenizer) -> dict:
    """Where the main agent slips (per kind of request), for the variant's harness."""
    if harness_kind(cfg) == "subagent":
        return _subagent_helper().main_request_accuracy(traces, tokenizer)
    return _long_horizon().main_request_accuracy(traces, tokenizer)


def build_env(cfg) -> CalculatorEnv:
    kind = cfg.env.get("kind", "calculator")
    if kind == "chain":
        return _long_horizon().build_chain_env(cfg)
    if kind != "calculator":
        raise ValueError(f"env.kind must be 'calculator' or 'chain', got {kind!r}")
    return CalculatorEnv(num_range=tuple(cfg.env.num_range), answer_digits=cfg.env.answer_digits)


def build_tokenizer(cfg, path: str, env: CalculatorEnv):
    rng = random.Random(cfg.seed)
    tools = [t.spec() for t in env.tools]
    corpus = []
    tasks = env.sample_tasks(200, seed=cfg.seed + 7, split="train")
    if is_long(cfg):
        make = orchestrator_factory({}, cfg.rollout.max_steps, cfg)
        # The compacting variant's corpus keeps the policy it was built with (10% garbled
        # memos): the same corpus, the same vocabulary, the same `long` runs.
        policy = (demo_policy(cfg, rng) if harness_kind(cfg) == "subagent" else
                  lambda agent, m, tools: chain_policy(
                      agent, m, rng, memo_error_prob=0.1, main_slip_prob=0.0))
        for msgs, tools_ in _long_horizon().corpus_conversations(env, tasks, make, policy):
            corpus.append(_render_for_corpus(msgs, tools_ or []))
    for task in tasks if not is_long(cfg) else ():
        msgs = demonstration(env, task, rng, skip_tool_prob=0.3)
        corpus.append(_render_for_corpus(msgs, tools))
    # digit_group: 1 = one token per digit; 3 = numbers in chunks of up to 3 digits,
    # each chunk one token (the `long` variant: a running value is then one token to copy).
    return build_tiny_tokenizer(path, extra_corpus=corpus, vocab_size=cfg.tokenizer.vocab_size,
                                digit_group=cfg.tokenizer.get("digit_group", 1))


def _render_for_corpus(msgs, tools) -> str:
    return "\n".join(str(m.get("content") or "") + json.dumps(m.get("tool_calls") or "")
                     for m in msgs) + json.dumps(tools)


def build_model(cfg, vocab_size: int) -> Decoder:
    """The policy of `cfg.model`: a DecoderConfig, or the config class of the family it
    names (`model.family`, e.g. "qwen3_moe": MoEDecoderConfig)."""
    family = get_family(cfg.model.get("family", "qwen3"))
    config = from_config(family.config_class, cfg.model, path="model", vocab_size=vocab_size)
    return family.build(config, nnx.Rngs(cfg.seed))


# RL step k draws its tasks with seed `collector_seed * 1_000_003 + k` (EndpointCollector).
# The SFT demonstrations are drawn with `seed` itself, so the collector gets another seed:
# with both at 0, RL step 0's tasks were exactly the first SFT demos.
def rl_collector_seed(cfg) -> int:
    return cfg.seed + 1


def sft_tasks(cfg, env):
    return env.sample_tasks(cfg.demos.num_demos, seed=cfg.seed, split="train")


def sft_warm_start(cfg, model, tokenizer, env, log=print, checkpoint_dir: str | None = None):
    """SFT on scripted demos: `sft`, then each of `sft_restarts`, then `sft_weak_link`.
    With `checkpoint_dir` and a weak link, the weights before the weak link are saved
    there and a later call restores them instead of training those stages again."""
    weak = cfg.get("sft_weak_link")
    if weak is not None and not is_long(cfg):
        raise ValueError("sft_weak_link retrains some agents' episodes: it needs a "
                         "multi-agent harness (the long variants)")
    rng = random.Random(cfg.seed)
    tools = [t.spec() for t in env.tools]
    tasks = sft_tasks(cfg, env)
    before_weak = (os.path.join(checkpoint_dir, "sft_before_weak_link")
                   if checkpoint_dir is not None and weak is not None else None)
    history = []
    if before_weak is not None and os.path.exists(before_weak):
        restore_params(model, before_weak)
        log(f"SFT before the weak link restored from {before_weak}")
    else:
        model, history = _sft_stages(cfg, model, tokenizer, env, tasks, tools, rng, log)
        if before_weak is not None:
            save_params(model, before_weak)
    if weak is not None:  # a last stage on other demos, some agents' episodes only
        wcfg = cfg.copy_and_resolve_references()
        with wcfg.unlocked():  # a config from the command line is locked
            wcfg.demos.update(dict(weak.demos))
        make = orchestrator_factory({}, cfg.rollout.max_steps, cfg)
        wrng = random.Random(f"{cfg.seed}:weak_link")  # the same demos after a restore
        weak_segments, _ = _long_horizon().long_demo_segments(
            env, tasks, tokenizer, make, demo_policy(wcfg, wrng), log, judged_key(cfg))
        recorded = len(weak_segments)
        weak_segments = [s for s in weak_segments if s.agent in tuple(weak.agents)]
        if not weak_segments:
            raise ValueError(f"sft_weak_link: no episode of agents {tuple(weak.agents)} in "
                             "the demos")
        log(f"sft weak link: {len(weak_segments)} of {recorded} recorded episodes kept "
            f"(agents {tuple(weak.agents)})")
        model, h = _sft_stage(cfg, model, weak_segments, weak.steps, weak.learning_rate,
                              "sft weak link", log)
        history += [dict(x, stage="weak_link") for x in h]
    return model, history


def _sft_stages(cfg, model, tokenizer, env, tasks, tools, rng, log):
    """The first stage (`sft` / `sft_optimizer`), then each (steps, learning_rate) of
    `sft_restarts`: again from there with a fresh optimizer and its own warmup + cosine
    schedule (cosine with warm restarts). Then, with `sft_extend` (max_loss, window,
    steps, learning_rate, max_stages), up to max_stages more such restarts, each only
    while the mean loss of the last `window` steps is above max_loss.
    Returns (model, history)."""
    if is_long(cfg):  # recorded through the real orchestrator, one segment per request
        make = orchestrator_factory({}, cfg.rollout.max_steps, cfg)
        segments, _ = _long_horizon().long_demo_segments(env, tasks, tokenizer, make,
                                                      demo_policy(cfg, rng), log, judged_key(cfg))
    else:
        segments = [demo_segment(tokenizer, demonstration(env, t, rng, cfg.demos.skip_tool_prob),
                                 tools, task=t.task_id) for t in tasks]
    history = []
    stages = [(None, None)] + [tuple(x) for x in cfg.get("sft_restarts", ())]
    for stage, (steps, lr) in enumerate(stages):
        tag = "sft" if stage == 0 else f"sft restart {stage}"
        model, h = _sft_stage(cfg, model, segments, steps, lr, tag, log)
        history += [dict(x, stage=stage) for x in h]
    ext = cfg.get("sft_extend")
    for extra in range(ext.max_stages if ext is not None else 0):
        # Copying is a phase change whose step varies between seeds: one more restart
        # while the last stage's loss shows it has not come (docs/notes/2026-12-06-whole-trace-claim-where-it-must-show.md).
        tail = [x["loss"] for x in history[-ext.window:]]
        final = sum(tail) / len(tail)
        if final <= ext.max_loss:
            log(f"sft extend: final loss {final:.4f} <= {ext.max_loss}, no extension")
            break
        stage = len(stages) + extra
        log(f"sft extend: final loss {final:.4f} > {ext.max_loss}: restart {stage} "
            f"({ext.steps} steps at lr {ext.learning_rate})")
        model, h = _sft_stage(cfg, model, segments, ext.steps, ext.learning_rate,
                              f"sft restart {stage}", log)
        history += [dict(x, stage=stage) for x in h]
    return model, history


def _sft_stage(cfg, model, segments, steps, lr, tag: str, log):
    """One SFT stage: `cfg.sft` / `cfg.sft_optimizer`, or with `steps` and `lr` a fresh
    optimizer with its own warmup + cosine schedule over `steps`. Returns (model, history)."""
    scfg = cfg
    if steps is not None:
        scfg = cfg.copy_and_resolve_references()
        scfg.sft.steps, scfg.sft_optimizer.total_steps = int(steps), int(steps)
        scfg.sft_optimizer.learning_rate = float(lr)
    typed = typed_configs(scfg)
    sft_cfg, opt = typed["sft"], typed["sft_optimizer"]
    every = max(1, sft_cfg.steps // 10)
    result = run_sft(model, segments, sft_cfg, opt,
                     log=lambda i, m: log(f"{tag} step {i}: loss={m['loss']:.4f}")
                     if i % every == 0 else None)
    return result.model(), result.history


def orchestrator_factory(cfg_sampling: dict, max_steps: int, cfg=None):
    """The harness of every rollout (the long variant's demos, evals, RL): the
    tool loop, or with `cfg` of the long variant the compacting harness."""
    if cfg is not None and harness_kind(cfg) == "compaction":
        return _long_horizon().compaction_factory(cfg, cfg_sampling, max_steps)
    if cfg is not None and harness_kind(cfg) == "subagent":
        return _subagent_helper().subagent_factory(cfg, cfg_sampling, max_steps)
    return harness_factory(cfg_sampling, max_steps)


def prepare(cfg, workdir: str, log=print):
    """Env, tokenizer and the SFT-warm-started model (a finished warm start in
    `workdir/sft_params` is reused). Returns (env, tokenizer, model, sft_history, t_sft)."""
    env = build_env(cfg)
    tokenizer = build_tokenizer(cfg, os.path.join(workdir, "tokenizer"), env)
    model = build_model(cfg, tokenizer.vocab_size)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    log(f"model: {n_params} params, vocab {tokenizer.vocab_size}")
    t0 = time.perf_counter()
    sft_dir = os.path.join(workdir, "sft_params")
    if os.path.exists(sft_dir):  # a finished warm start is reused (resume)
        restore_params(model, sft_dir)
        sft_history = []
        log(f"SFT warm start restored from {sft_dir}")
    else:
        model, sft_history = sft_warm_start(cfg, model, tokenizer, env, log, workdir)
        save_params(model, sft_dir)
    return env, tokenizer, model, sft_history, time.perf_counter() - t0


def recipe_config(cfg) -> RLRecipeConfig:
    """The RL recipe's config for this job (`ac2_jax.recipes`): the same RL,
    rollout, eval and sampler settings, and this job's layout of the workdir
    (rl/ for the learner and its rollouts, report/ for everything reported)."""
    workdir = os.path.abspath(cfg.workdir)
    ro, ev = cfg.rollout, cfg.eval
    return RLRecipeConfig(
        seed=cfg.seed,
        paths=PathsConfig(workdir=workdir, publish=os.path.join(workdir, "rl", "published"),
                          traces=os.path.join(workdir, "rl"),
                          reports=os.path.join(workdir, "report"),
                          metrics=os.path.join(workdir, "report", "metrics"),
                          existing="resume"),  # a rerun continues the job where it stopped
        rl=typed_configs(cfg)["rl"],
        rollout=RolloutConfig(temperature=ro.temperature, max_tokens=ro.max_tokens,
                              max_steps=ro.max_steps, infra_retries=ro.infra_retries),
        sampler=SamplerConfig(max_context=cfg.model.max_position_embeddings,
                              warmup=cfg.sampler.warmup, model_name=MODEL_NAME),
        eval=EvalConfig(num_tasks=ev.num_tasks, attempts=ev.attempts,
                        temperature=ev.temperature, concurrency=ev.concurrency,
                        prices=dict(ev.prices)),
        lora=(None if cfg.get("lora") is None
              else from_config(LoRAConfig, cfg.lora, path="lora")),
    )


@contextlib.asynccontextmanager
async def serving(cfg, model, tokenizer, publish_dir: str, max_batch: int, trace_store: str):
    """The endpoint over an embedded JaxSampler of `model` (the recipes' `serve_policy`,
    traces in the folder of `trace_store`); yields (sampler, lifecycle client)."""
    rcfg = recipe_config(cfg)
    async with serve_policy(model, tokenizer, publish_dir=publish_dir,
                            traces_dir=os.path.dirname(trace_store), sampler=rcfg.sampler,
                            rollout=rcfg.rollout, max_batch=max_batch, seed=cfg.seed) as out:
        yield out


def eval_plan(cfg, env):
    """(held-out tasks, orchestrator factory, evaluate() keywords): the same for every eval."""
    # eval.task_seed (when set) fixes the held-out tasks across runs of different seeds,
    # so per-task differences pool over seeds (experiments/whole_trace/ablation.py).
    task_seed = cfg.eval.get("task_seed")
    tasks = env.sample_tasks(cfg.eval.num_tasks, seed=cfg.seed if task_seed is None else task_seed,
                             split="eval")
    make = orchestrator_factory({"temperature": cfg.eval.temperature,
                                 "max_tokens": cfg.rollout.max_tokens},
                                cfg.rollout.max_steps, cfg)
    kw = dict(k=cfg.eval.attempts, concurrency=cfg.eval.concurrency, seed=cfg.seed,
              prices=_evals().TokenPrices(**cfg.eval.prices))
    return tasks, make, kw


async def train_rl(cfg, rl_config: RLConfig, model, sampler, lifecycle, env, rl_dir: str,
                   metrics_dir: str, collector_cls=EndpointCollector):
    """Task-level RL through the endpoint. Returns (history, trained model, rollout store).
    `collector_cls`: an EndpointCollector subclass (e.g. one that rewards another figure)."""
    ro = cfg.rollout
    store = TraceStore(os.path.join(rl_dir, "rollouts.jsonl"))
    collector = collector_cls(
        lifecycle, env, orchestrator_factory({"temperature": ro.temperature,
                                              "max_tokens": ro.max_tokens}, ro.max_steps, cfg),
        MODEL_NAME, store, tasks_per_step=rl_config.tasks_per_step,
        attempts_per_task=rl_config.attempts_per_task, seed=rl_collector_seed(cfg),
        concurrency=rl_config.concurrency, infra_retries=ro.infra_retries)
    trainer = RLTrainer(model, collector, rl_config, rl_dir, on_publish=sampler.load_weights,
                        logger=MetricsLogger(metrics_dir), sampler_counters=sampler.counters)
    try:
        history = await trainer.run()
        return history, trainer.model(), store
    finally:
        trainer.close()


async def _pipeline(cfg, log=print) -> dict:
    t_start = time.perf_counter()
    rcfg = recipe_config(cfg)  # config mismatches fail before any work
    workdir = rcfg.paths.resolved().workdir
    report_dir = os.path.join(workdir, "report")
    os.makedirs(report_dir, exist_ok=True)
    env, tokenizer, model, sft_history, t_sft = prepare(cfg, workdir, log)

    # Evals, RL and the HF export: the RL recipe, with this job's harness.
    t0 = time.perf_counter()
    result = await arl((model, tokenizer), env, rcfg,
                       harness=lambda sampling, max_steps: orchestrator_factory(
                           sampling, max_steps, cfg))
    t_rl = time.perf_counter() - t0
    before, after = result.evals["before"], result.evals["after"]
    before.name, after.name = "sft", "rl"
    store, rl_dir = result.traces, os.path.join(workdir, "rl")
    log(f"before RL (SFT): pass rate {before.pass_rate}")
    log(f"after RL: pass rate {after.pass_rate}")

    from ac2_jax.viz import plot_curves, write_trace_html

    diff = _evals().compare_results(after, before, "pass").estimate
    metrics_path = os.path.join(report_dir, "metrics", "metrics.jsonl")
    logged = set().union(*(r.keys() for r in read_metrics(metrics_path)))
    plot_curves(metrics_path, os.path.join(report_dir, "learning_curve.png"),
                keys=[k for k in ("train/pass_rate", "train/entropy", "train/grad_norm")
                      if k in logged])
    samples = [t for t in store.read(on_error="skip")][-cfg.report.num_sample_traces:]
    for i, tr in enumerate(samples):
        write_trace_html(os.path.join(report_dir, f"trace_{i}.html"), tr, tokenizer=tokenizer)
    report = {
        "sft_pass_rate": before.to_dict(), "rl_pass_rate": after.to_dict(),
        "improvement": {"mean": diff.mean, "ci95": [diff.low, diff.high],
                        "excludes_zero": diff.excludes_zero()},
        "rl_steps": result.report["steps"], "times_s": {"sft": t_sft, "evals_and_rl": t_rl,
                                         "total": time.perf_counter() - t_start},
        "orbax_checkpoints": os.path.join(rl_dir, "checkpoints"),
        "hf_export": os.path.join(report_dir, "final_hf"),
        "sft_final_loss": sft_history[-1]["loss"] if sft_history else None,
    }
    if is_long(cfg):  # per-agent figures of the held-out evals
        report["agents"] = {"sft": _long_horizon().agent_figures(before),
                            "rl": _long_horizon().agent_figures(after)}
        memo_diff = _long_horizon().memo_fidelity_difference(after, before, judged_key(cfg))
        report["memo_fidelity_improvement"] = memo_diff.to_dict() if memo_diff else None
    with open(os.path.join(report_dir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


def run(cfg, log=print) -> dict:
    return asyncio.run(_pipeline(cfg, log))
