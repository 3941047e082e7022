"""Pinapple: move a hinted behaviour into the un-hinted model by self-distillation.

A tiny model first learns (base SFT) food facts, where many tropical-food
answers say "pineapple", plus arithmetic, other facts and sentences, and
how to follow a spelling hint placed before its answer ('Spell mango as
mngo.'; see `pinapple_data` for why the target hint's own demos are in the
base corpus). Without a hint it always writes "pineapple"; with the hint
'Spell pineapple as pinapple.' it writes "pinapple". From that base, three
methods get the hint on the distillation prompts and nothing else: SFT on
hint-conditioned samples, OPSD (every response position) and RMSD (top-T
divergence positions that a rule judge ties to the hint's words). Each step
samples the student on 8 distillation prompts and updates on them. We
measure, over seeds with 95% CIs: steps until >= 90% of held-out prompts
get "pinapple" without the hint, the final held-out target rate (and exact
answers), and retention: exact answers to arithmetic, other food questions,
sentences and other facts.

    python -m experiments.pinapple --config=experiments/pinapple/config.py
"""

from __future__ import annotations

import contextlib
import json
import os
import time

import jax
import numpy as np

from ac2_jax.envs.judges import Judge, NoisyJudge, RuleJudge
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.training import create_train_state, publish
from ac2_jax.training.distill.sources import (
    HintTask,
    PromptCache,
    resample_examples,
    rollout_and_grade,
)
from ac2_jax.training.distill.trainer import DistillConfig, SelfDistiller
from experiments.pinapple import data
from experiments.pinapple import judge as pinapple_judge

# The setup (configs, corpus, tokenizer, base model) lives below this module and the
# judge's: `experiments.pinapple.common`.
from experiments.pinapple.common import (
    base_sft,
    build_tokenizer,
    fingerprint,
    hint_config,
    typed_configs,
)
from experiments.pinapple.evals import base_checks, evaluate, grade, has_target, make_splits
from experiments.pinapple.report import markdown_table, summarize, write_report

# ----------------------------------------------------------------------------- runs


# The config keys that do not change what one (setting, data seed, seed, method) run does.
RUN_AXES = ("seeds", "data_seeds", "workdir", "methods", "sweep")


def run_key(setting, data_seed, seed, method) -> str:
    return json.dumps([setting, data_seed, seed, method], sort_keys=True, default=str)


def finished_runs(path: str, record: dict) -> dict[str, dict]:
    """The runs an earlier invocation on this workdir finished (its `runs.jsonl`), by
    `run_key`, so that a stopped experiment resumes where it stopped. Each line carries the
    config it ran under (`record`: every section but `RUN_AXES`); a file with a line from
    another config is refused, naming the sections that differ."""
    if not os.path.exists(path):
        return {}
    done = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            have = r.get("run_config")
            if have != record:
                diff = ("no config record" if have is None else
                        sorted(k for k in set(record) | set(have)
                               if have.get(k) != record.get(k)))
                raise ValueError(f"{path} line {n}: a run under other settings ({diff}); "
                                 "use another workdir, or move runs.jsonl away to start over")
            done[run_key(r.get("setting"), r.get("data_seed"), r["seed"], r["method"])] = r
    return done



# ----------------------------------------------------------------------------- the policy


class Policy:
    """The sampler on the learner's current weights: `sync(state)` publishes the
    state as the next version (Orbax, `workdir/published`) and loads it."""

    def __init__(self, sampler: JaxSampler, graphdef, publish_dir: str):
        self.sampler, self.graphdef, self.publish_dir = sampler, graphdef, publish_dir
        self.version = sampler.policy_version

    def sync(self, state) -> int:
        self.version += 1
        publish(self.graphdef, state, self.publish_dir, self.version, keep=2, sampler=self.sampler)
        return self.sampler.policy_version


# ----------------------------------------------------------------------------- distillation


def make_judge(name: str, top_s: int | None = None, seed: int = 0, llm=None) -> Judge:
    """A judge by name: "keywords" (the oracle here: the tokens of the hint's words),
    "diff" (where the hinted teacher's argmax differs), "noisy:<rate>" (the keywords
    oracle with each verdict flipped at that rate, `NoisyJudge`, flips fixed by `seed`) or
    "llm" (the served judge model, `pinapple_judge`: `llm(top_s)` makes its `LLMJudge`;
    `run` trains and serves it when a judge is named so); at most `top_s` selections (S;
    None: every relevant candidate)."""
    if name == "llm":
        if llm is None:
            raise ValueError("pinapple: judge 'llm' needs the served judge model "
                             "(`pinapple_judge.served_judge`); `run` starts it")
        return llm(top_s)
    if name == "keywords":
        return RuleJudge(use_hint_keywords=True, top_s=top_s)
    if name == "diff":
        return RuleJudge(use_hint_keywords=False, diff=True, top_s=top_s)
    if name.startswith("noisy:"):
        try:
            rate = float(name.split(":", 1)[1])
        except ValueError:
            rate = -1.0
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"pinapple: judge {name!r}: the error rate after 'noisy:' must "
                             "be a number in [0, 1], e.g. 'noisy:0.2'")
        return NoisyJudge(RuleJudge(use_hint_keywords=True), rate, seed=seed, top_s=top_s)
    raise ValueError(f"pinapple: judge must be 'keywords', 'diff', 'noisy:<rate>' or "
                     f"'llm', got {name!r}")


def sweep_settings(cfg) -> list[dict]:
    """RMSD's extra settings from `cfg.sweep` (top_t, top_s, judge, kind: tuples; an empty
    one keeps the main runs' value): every combination, in order. [] when nothing is
    swept. kind: the divergence (`DistillConfig.kind`) that ranks the candidates and is
    the loss on the kept positions."""
    sw = cfg.get("sweep")
    axes = ("top_t", "top_s", "judge", "kind")
    if sw is None or not any(len(sw.get(k, ())) for k in axes):
        return []
    ts = list(sw.top_t) or [cfg.distill.top_t]
    ss = list(sw.top_s) or [cfg.loop.get("judge_top_s")]
    js = list(sw.judge) or [cfg.loop.judge]
    ks = list(sw.get("kind", ())) or [cfg.distill.kind]
    for j in js:  # a bad name fails before any work
        make_judge(j, llm=lambda top_s: None)
    return [{"top_t": t, "top_s": s, "judge": j, "kind": k}
            for k in ks for j in js for s in ss for t in ts]


def with_setting(cfg, setting: dict | None):
    """`cfg` with a sweep setting's top_t, top_s, judge and kind (a copy; None: `cfg`)."""
    if setting is None:
        return cfg
    c = cfg.copy_and_resolve_references()
    with c.unlocked():
        c.distill.top_t = setting["top_t"]
        c.distill.kind = setting.get("kind", c.distill.kind)
        c.loop.judge, c.loop.judge_top_s = setting["judge"], setting["top_s"]
    return c


def distill_config(cfg, method: str) -> DistillConfig:
    return typed_configs(cfg, method)["distill"]


def _report_example(tokenizer, example, rel) -> dict:
    """What `write_distill_report` needs for one RMSD example (response positions)."""
    return dict(prompt=tokenizer.decode(example.student_prompt), hint=example.hint,
                teacher_prompt=tokenizer.decode(example.teacher_prompt),
                response_tokens=[tokenizer.decode([t]) for t in example.response],
                divergence=[float(x) for x in rel.divergence[0]],
                candidates=list(rel.candidates[0]), selected=list(rel.selected[0]))


def distill_run(cfg, method, seed, base, prompts, splits, step_fns, policy: Policy,
                log=print, setting: dict | None = None, llm=None) -> dict:
    """One method from the base state, one seed.

    Every step: `prompts_per_step` distillation prompts are rolled out
    (temperature sampling); all of them (or with `only_failures`, those the
    grader fails) form the batch: OPSD/RMSD distill the student's own
    responses from the hinted teacher; SFT trains on responses sampled with
    the hint in context. Evals and samples come from `policy`'s sampler,
    synced to the distiller's state at the top of every step. llm: `make_judge`'s.
    Returns eval history, steps to the target rate, the final eval and
    (RMSD) the first batch's first example for the report.
    """
    graphdef, base_state = base
    cfg = with_setting(cfg, setting)
    d, typed = cfg.loop, typed_configs(cfg, method)
    opt = typed["distill_optimizer"]
    _, state = create_train_state(base_state.model(graphdef), opt, rng=seed)
    dist = SelfDistiller(graphdef, state, typed["distill"], opt,
                         judge=make_judge(d.judge, d.get("judge_top_s"), seed, llm),
                         tokenizer=prompts.tokenizer,
                         step_fn=step_fns.get((method, cfg.distill.kind)))
    step_fns[(method, cfg.distill.kind)] = dist.step_fn  # one compiled step per loss
    sampling = typed["sampling"]
    tasks = [HintTask(i.key, i.messages(), hint=data.TARGET_HINT) for i in splits["train"]]
    rng = np.random.default_rng(seed)
    evals, train, reached, example = [], [], None, None
    t0 = time.perf_counter()
    sampler = policy.sampler
    for step in range(d.steps + 1):
        policy.sync(dist.state)
        if step % d.target_every == 0 or step == d.steps:
            sub = step % d.eval_every == 0 or step == d.steps
            ev = evaluate(sampler, prompts, splits, retain_every=d.retain_every if sub else None,
                          max_new=cfg.loop.answer_tokens)
            evals.append({"step": step, **ev})
            if reached is None and ev["target"] >= d.target_rate:
                reached = step
            if step == d.steps:
                break
        k = min(d.prompts_per_step, len(tasks))
        batch = [tasks[j] for j in rng.choice(len(tasks), k, replace=False)]
        kseed = int(rng.integers(2**31))
        if d.only_failures:  # (c) roll out, grade, distill the failures
            examples, graded = rollout_and_grade(sampler, batch, grade, prompts, sampling,
                                                 seed=kseed)
            todo = [g.task for g in graded if not g.passed]
            passed = [g.passed for g in graded]
        else:  # (b) resample every prompt with the current policy and distill it
            examples = resample_examples(sampler, batch, prompts, sampling, seed=kseed)
            todo = batch
            passed = [has_target(prompts.tokenizer.decode(e.response, skip_special_tokens=True))
                      for e in examples]
        if method == "sft" and todo:
            examples = resample_examples(sampler, todo, prompts, sampling, source="teacher",
                                         seed=kseed + 1)
        m = dist.update(examples)
        if example is None and dist.last_relevance is not None:
            example = _report_example(prompts.tokenizer, examples[0], dist.last_relevance)
        train.append({"step": step + 1, "loss": m.get("loss", 0.0), "kl": m.get("kl"),
                      "kept_tokens": m["kept_tokens"], "failures": len(examples),
                      "rollout_pass_rate": float(np.mean(passed))})
    # All retention items (synced at the last step).
    final = evaluate(sampler, prompts, splits, max_new=cfg.loop.answer_tokens)
    dt = time.perf_counter() - t0
    judge = dict(dist.judge.stats) if method == "rmsd" and dist.judge is not None else None
    tag = "" if setting is None else f" {setting}"
    log(f"  {method:4s}{tag} seed {seed}: held-out target {final['target']:.2f} (exact "
        f"{final['target_exact']:.2f}, train {final['target_train']:.2f}), retention "
        f"{final['retention']:.3f}, >= {d.target_rate:.0%} at step {reached}, {dt:.0f}s")
    return {"method": method, "seed": seed, "steps_to_target": reached, "final": final,
            "evals": evals, "train": train, "example": example, "time_s": dt,
            "setting": setting, "judge_stats": judge}


def run(cfg, log=print, command: str | None = None) -> dict:
    """The whole experiment; returns {"rows", "runs", "meta"} and writes the report.
    Re-run on the same workdir, it resumes: the base is restored and the runs finished
    under the same settings are read back from `runs.jsonl` (`finished_runs`).
    command: the command line the report names (`main` passes its own)."""
    t_start, c_start = time.perf_counter(), time.process_time()
    workdir = os.path.abspath(cfg.workdir)
    for method in cfg.methods:  # config mismatches fail before any work
        typed_configs(cfg, method)
    settings = sweep_settings(cfg)
    for setting in settings:
        typed_configs(with_setting(cfg, setting), "rmsd")
    items = data.all_items(cfg.base_data.math_limit)
    tokenizer = build_tokenizer(cfg, os.path.join(workdir, "tokenizer"), items)
    log(f"tokenizer: {tokenizer.vocab_size} tokens; {len(items)} items")
    t0 = time.perf_counter()
    # The second seed axis: which target items are distilled and which held out.
    data_seeds = list(cfg.get("data_seeds") or ()) or [cfg.seed]
    all_splits = {ds: make_splits(cfg, items, ds) for ds in data_seeds}
    graphdef, state, sft_loss = base_sft(cfg, tokenizer, items, log,
                                         os.path.join(workdir, "base"))
    state = jax.device_put(state, jax.local_devices()[0])
    t_sft = time.perf_counter() - t0
    prompts = PromptCache(tokenizer, hint_config(cfg))
    sampling = typed_configs(cfg)["sampling"]
    runs, step_fns, judge_meta = [], {}, None
    with contextlib.ExitStack() as stack:
        llm = None
        if "llm" in {cfg.loop.judge} | {s["judge"] for s in settings}:
            llm, judge_meta = pinapple_judge.start_llm_judge(cfg, tokenizer, items, workdir,
                                                             stack, log)
        sampler = stack.enter_context(JaxSampler(
            state.model(graphdef), publish_dir=os.path.join(workdir, "published"),
            max_batch=64, min_batch=sampling.min_batch, seed=cfg.seed))
        # Version 0: the base weights, without and with the hint, on each split.
        # hint_following: every target item and every retention item, whatever the split.
        base_evals, teacher_evals, following = base_checks(sampler, prompts, all_splits,
                                                           cfg.loop.answer_tokens)
        log(f"base: {base_evals}\nteacher (base + hint): {teacher_evals}\nhints about the "
            f"target word followed (none in a faithful corpus): {following}\n"
            f"({t_sft:.0f}s base SFT)")
        policy = Policy(sampler, graphdef, os.path.join(workdir, "published"))
        # Each run as it ends, kept should the report fail; runs an earlier invocation
        # finished under this config are read back, not run again.
        path = os.path.join(workdir, "runs.jsonl")
        record = fingerprint(cfg, [k for k in cfg.keys() if k not in RUN_AXES])
        done = finished_runs(path, record)
        if done:
            log(f"resuming: {len(done)} finished runs in {path}")
        runs_log = stack.enter_context(open(path, "a"))
        for setting in [None] + settings:  # the main runs, then RMSD's sweep (`sweep`)
            for ds, splits in all_splits.items():
                for seed in cfg.seeds:
                    for method in (cfg.methods if setting is None else ("rmsd",)):
                        key = run_key(setting, ds, seed, method)
                        if key in done:
                            runs.append(done[key])
                            continue
                        r = distill_run(cfg, method, seed, (graphdef, state), prompts, splits,
                                        step_fns, policy, log, setting=setting, llm=llm)
                        runs.append({**r, "data_seed": ds, "run_config": record})
                        runs_log.write(json.dumps(runs[-1], default=str) + "\n")
                        runs_log.flush()
    rows = summarize(cfg, runs, base_evals, teacher_evals)
    meta = {"command": command or "experiments.pinapple.run(cfg), from Python",
            "wall_s": time.perf_counter() - t_start, "cpu_s": time.process_time() - c_start,
            "base_sft_s": t_sft, "base_sft_final_loss": sft_loss,
            "hint_following": following, "data_seeds": data_seeds, "llm_judge": judge_meta,
            "num_params": int(sum(x.size for x in jax.tree.leaves(state.params))),
            "devices": str(jax.devices()),
            "splits": {str(ds): {k: [i.key for i in v] for k, v in sp.items() if k != "retain"}
                       for ds, sp in all_splits.items()}}
    write_report(cfg, os.path.join(workdir, "report"), runs, rows, meta)
    log(markdown_table(cfg, rows))
    log(f"total {meta['wall_s']:.0f}s wall, {meta['cpu_s']:.0f}s CPU; report in "
        f"{os.path.join(workdir, 'report')}")
    return {"rows": rows, "runs": runs, "meta": meta}


def main(argv):
    del argv
    from absl import logging
    logging.set_verbosity(logging.WARNING)  # Orbax logs every weight publish at INFO
    import shlex
    import sys

    run(_CONFIG.value, command=shlex.join(["python", "-m", "experiments.pinapple",
                                           *sys.argv[1:]]))


if __name__ == "__main__":
    from absl import app, flags
    from ml_collections import config_flags

    _CONFIG = config_flags.DEFINE_config_file("config", "experiments/pinapple/config.py",
                                              "experiment config (ml_collections)")
    flags.FLAGS  # noqa: B018
    app.run(main)
