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

    python -m experiments.pinapple --config=experiments/configs/pinapple.py
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time

import jax
import numpy as np
from flax import nnx

from ac2_jax.config import from_config
from ac2_jax.envs.judges import Judge, NoisyJudge, RuleJudge
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.models.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.training import OptimizerConfig, SFTConfig, create_train_state, run_sft
from ac2_jax.training.sft.demos import demo_segment
from ac2_jax.training.distill.trainer import DistillConfig, SelfDistiller
from ac2_jax.training.distill.data import HintConfig, hinted_messages
from ac2_jax.sampling.jax_sampler import JaxSampler
from ac2_jax.training.distill.sources import (HintTask, PromptCache, SampleConfig, publish_policy,
                                              resample_examples, rollout_and_grade)
from experiments import pinapple_data as data
from experiments.pinapple_evals import base_checks, evaluate, grade, has_target, make_splits
from experiments.pinapple_report import markdown_table, summarize, write_report

# ----------------------------------------------------------------------------- setup


def typed_configs(cfg, method: str | None = None) -> dict:
    """The config's dataclass sections, converted (a mismatch names its key).

    Keys: sft, sft_optimizer, hint, distill_optimizer, sampling and, given
    `method`, distill (its DistillConfig). The model's DecoderConfig needs the
    tokenizer's vocab_size: see `build_model`.
    """
    out = {"sft": from_config(SFTConfig, cfg.sft, path="sft"),
           "sft_optimizer": from_config(OptimizerConfig, cfg.sft_optimizer, path="sft_optimizer"),
           "hint": from_config(HintConfig, cfg.hint, path="hint"),
           "distill_optimizer": from_config(OptimizerConfig, cfg.distill_optimizer,
                                            path="distill_optimizer"),
           "sampling": from_config(SampleConfig, cfg.sampling, path="sampling")}
    if method is not None:
        out["distill"] = from_config(DistillConfig, cfg.distill, path="distill", method=method)
    return out


def hint_config(cfg) -> HintConfig:
    return from_config(HintConfig, cfg.hint, path="hint")


def word_pool(cfg, items) -> list[str]:
    """The words the hint families and "Repeat:" items draw from: every answer word and
    `base_data.nonce_words` made-up ones; the target word only with target_word_hints."""
    nonce = data.nonce_words(cfg.base_data.get("nonce_words", 0), cfg.seed)
    words = [w for w in data.answer_words(items) + nonce if w != data.TARGET_WORD]
    # With target_word_hints the target word is a word like any other, in "Repeat:" items
    # too (hints then rewrite it there as well); swap never replaces a word with it.
    return words + ([data.TARGET_WORD] if cfg.base_data.get("target_word_hints") else [])


def corpus_items(cfg, items):
    """The base corpus's items: `items` and `base_data.repeat_items` "Repeat: ..." items."""
    n = cfg.base_data.get("repeat_items", 0)
    return items + data.repeat_items(n, word_pool(cfg, items), random.Random(cfg.seed + 2))


def _hint_demos(cfg, items, rng):
    """(item, hint, answer, placement) for the base corpus's hint-following demos.

    With `base_data.families` (the faithful setup): hints of those families
    (`pinapple_data.FAMILIES`; `spell_edits`, `spell_fresh`: the spell family's new
    words) about any word (the target one only with `target_word_hints`), on every kind of
    item (`fact_demo_frac`: a share on the fact items alone). Else:
    a `target_hint_frac` share uses the target hint, two thirds on items whose answer has
    pineapple (the answer writes the target spelling), one third on items without it (the
    answer stays); the rest are random misspellings of other words.
    """
    families = tuple(cfg.base_data.get("families", ()))
    pool = word_pool(cfg, items) if families else None
    # A `fact_demo_frac` share of the family demos is on fact items (not "Repeat:"), where
    # the target prompts' contexts are; 0: every demo's item drawn from all the items.
    fact_frac = cfg.base_data.get("fact_demo_frac", 0.0)
    facts = [i for i in items if i.kind != "repeat"]
    word = data.TARGET_WORD
    with_t = [i for i in items if word in i.answer and word not in i.question]
    others = [i for i in items if data.TARGET_WORD not in i.answer]
    out = []
    while len(out) < cfg.base_data.hint_demos:
        place = rng.choice(tuple(cfg.base_data.placements))
        if families:
            item = rng.choice(facts if fact_frac and rng.random() < fact_frac else items)
            demo = data.family_hint_demo(item, rng, rng.random() >= cfg.base_data.irrelevant_frac,
                                         rng.choice(families), pool,
                                         cfg.base_data.get("target_word_hints", False),
                                         cfg.base_data.get("spell_edits", 1),
                                         cfg.base_data.get("spell_fresh", 0.0))
            if demo is not None:
                out.append((item, *demo, place))
            continue
        if rng.random() < cfg.base_data.target_hint_frac:
            if rng.random() < 2 / 3:
                item = rng.choice(with_t)
                out.append((item, data.TARGET_HINT, data.with_target_spelling(item.answer), place))
            else:
                out.append((rng.choice(others), data.TARGET_HINT, None, place))
            continue
        item = rng.choice(items)
        demo = data.hint_demo(item, rng, relevant=rng.random() >= cfg.base_data.irrelevant_frac)
        if demo is not None:
            out.append((item, *demo, place))
    return [(i, h, i.answer if a is None else a, p) for i, h, a, p in out]


def build_tokenizer(cfg, path: str, items):
    rng = random.Random(cfg.seed)
    items = corpus_items(cfg, items)
    corpus = [f"{i.question} {i.answer}" for i in items] * 3
    corpus += [f"{h} {a}" for _, h, a, _ in _hint_demos(cfg, items, rng)]
    return build_tiny_tokenizer(path, extra_corpus=corpus, vocab_size=cfg.tokenizer.vocab_size,
                                individual_digits=True)


def build_model(cfg, vocab_size: int, seed: int) -> Decoder:
    config = from_config(DecoderConfig, cfg.model, path="model", vocab_size=vocab_size)
    return Decoder(config, rngs=nnx.Rngs(seed))


def base_segments(cfg, tokenizer, items):
    """Facts (repeated), "Repeat:" items + hint-following demos as SFT segments (see
    `_hint_demos`)."""
    rng = random.Random(cfg.seed + 1)
    items = corpus_items(cfg, items)
    segs = []
    for it in items:
        msgs = list(it.messages()) + [{"role": "assistant", "content": it.answer}]
        segs += [demo_segment(tokenizer, msgs, task=it.key)] * cfg.base_data.repeats
    for k, (it, hint, answer, placement) in enumerate(_hint_demos(cfg, items, rng)):
        msgs = hinted_messages(it.messages(), hint, HintConfig(placement=placement))
        msgs.append({"role": "assistant", "content": answer})
        segs.append(demo_segment(tokenizer, msgs, task=f"hint/{k}"))
    return segs


# The config sections that make the base model: a base checkpoint is reused only for these.
BASE_SECTIONS = ("seed", "tokenizer", "model", "base_data", "sft", "sft_optimizer")


def fingerprint(cfg, sections) -> dict:
    d = cfg.to_dict()
    return json.loads(json.dumps({k: d[k] for k in sections}, sort_keys=True, default=str))


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


def checkpointed_sft(name: str, model, segments, sft, opt, workdir: str | None,
                     record: dict | None = None, log=print):
    """`run_sft` of `model` on `segments`: (graphdef, state, final loss). With a workdir it
    checkpoints there and resumes (a finished run trains nothing, and its final loss is
    read back); `workdir/<name>.json` keeps `record` (the config that makes the model),
    and a workdir holding another record is refused, naming the sections that differ."""
    path = None if workdir is None else os.path.join(workdir, f"{name}.json")
    if path is not None:
        os.makedirs(workdir, exist_ok=True)
        if os.path.exists(path):
            with open(path) as f:
                have = json.load(f)
            if have["config"] != record:
                diff = sorted(k for k in record if have["config"].get(k) != record[k])
                raise ValueError(f"{name}: {workdir} holds a model trained with other {diff} "
                                 "settings; use another workdir, or delete that one to retrain")
        else:
            with open(path, "w") as f:
                json.dump({"config": record, "final_loss": None}, f, indent=1)
    every = max(1, sft.steps // 6)
    res = run_sft(model, segments, sft, opt, workdir=workdir,
                  log=lambda i, m: log(f"  {name} sft step {i}: loss {m['loss']:.4f}")
                  if i % every == 0 else None)
    final = res.history[-1]["loss"] if res.history else None
    if path is not None:
        with open(path) as f:
            rec = json.load(f)
        if final is None:  # restored a finished run: its recorded loss
            final = rec["final_loss"]
            log(f"  {name} sft: restored the finished model from {workdir}")
        else:
            rec["final_loss"] = final
            with open(path, "w") as f:
                json.dump(rec, f, indent=1)
    return res.graphdef, res.state, final


def base_sft(cfg, tokenizer, items, log=print, workdir: str | None = None):
    """The base model: (graphdef, state, final loss), checkpointed in `workdir`
    (`checkpointed_sft`; the config sections of `BASE_SECTIONS` make it)."""
    typed = typed_configs(cfg)
    return checkpointed_sft("base", build_model(cfg, tokenizer.vocab_size, cfg.seed),
                            base_segments(cfg, tokenizer, items), typed["sft"],
                            typed["sft_optimizer"], workdir, fingerprint(cfg, BASE_SECTIONS),
                            log)


# ----------------------------------------------------------------------------- the policy


class Policy:
    """The sampler on the learner's current weights: `sync(state)` publishes the
    state as the next version (Orbax, `workdir/published`) and loads it."""

    def __init__(self, sampler: JaxSampler, graphdef, publish_dir: str):
        self.sampler, self.graphdef, self.publish_dir = sampler, graphdef, publish_dir
        self.version = sampler.policy_version

    def sync(self, state) -> int:
        self.version += 1
        return publish_policy(self.sampler, self.graphdef, state, self.publish_dir, self.version)


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

def start_llm_judge(cfg, tokenizer, items, workdir, stack, log):
    """Trains (or restores, `workdir/judge`) and serves the LLM judge for the run, entered
    on `stack`. Returns (`make_judge`'s llm, the judge's agreement with the oracle on
    held-out examples of other hints and on the held-out hints about the target word)."""
    from experiments import pinapple_judge as pj

    jdir = os.path.join(workdir, "judge")
    corpus, pool = corpus_items(cfg, items), word_pool(cfg, items)
    judge = pj.train_judge(cfg, tokenizer, corpus, pool, jdir, log)
    llm = stack.enter_context(pj.served_judge(judge, jdir))
    # Held out: examples of other hints drawn with another seed, none of them a training one.
    tests = {"other_hints": pj.judge_examples(tokenizer, corpus, pool,
                                              cfg.judge_data.test_examples, cfg.seed + 1,
                                              exclude=judge.trained_on),
             "target_hints": pj.target_examples(tokenizer, items, cfg.seed)}
    meta = {"final_loss": judge.final_loss,
            **{k: pj.agreement(llm(None), v) for k, v in tests.items()}}
    log(f"llm judge vs the oracle: {json.dumps(meta)}")
    return llm, meta


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
            llm, judge_meta = start_llm_judge(cfg, tokenizer, items, workdir, stack, log)
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

    _CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/pinapple.py",
                                              "experiment config (ml_collections)")
    flags.FLAGS  # noqa: B018
    app.run(main)
