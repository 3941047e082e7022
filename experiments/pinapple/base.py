"""The pinapple base alone: base SFT, then whether it follows hints it never saw.

Issue 39 asks for a base model that follows an unseen hint in context before any
distillation. This runs only that part of `experiments/pinapple/run.py` (the same corpus,
tokenizer, base SFT and checks): the base's greedy evals without a hint and under the
target hint, and `pinapple_evals.hint_following` (per held-out hint, the share of target prompts
answered exactly as the hint makes them; the target hint leaving other answers unchanged;
spell hints about other words with fresh misspellings). Writes `base_report.json` into
the workdir and prints a few answers under each held-out hint. The base checkpoints in
`workdir/base`, which `experiments/pinapple/run.py` with the same config and workdir reuses.

    python -m experiments.pinapple.base --config=experiments/pinapple/config.py:faithful
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

from experiments.pinapple import data, evals
from experiments.pinapple import run as pinapple


def run(cfg, log=print) -> dict:
    from ac2_jax.sampling.engine.jax_sampler import JaxSampler
    from ac2_jax.training.distill.sources import PromptCache

    t0 = time.perf_counter()
    workdir = os.path.abspath(cfg.workdir)
    items = data.all_items(cfg.base_data.math_limit)
    tok = pinapple.build_tokenizer(cfg, os.path.join(workdir, "tokenizer"), items)
    log(f"tokenizer: {tok.vocab_size} tokens; {data.TARGET_WORD!r} -> "
        f"{tok.encode(' ' + data.TARGET_WORD)}, {data.TARGET_SPELLING!r} -> "
        f"{tok.encode(' ' + data.TARGET_SPELLING)}")
    graphdef, state, final_loss = pinapple.base_sft(cfg, tok, items, log,
                                                    os.path.join(workdir, "base"))
    t_sft = time.perf_counter() - t0
    splits = evals.make_splits(cfg, items, cfg.seed)
    prompts = PromptCache(tok, pinapple.hint_config(cfg))
    n = cfg.loop.answer_tokens
    with JaxSampler(state.model(graphdef), publish_dir=os.path.join(workdir, "published"),
                    max_batch=64, min_batch=cfg.sampling.min_batch, seed=cfg.seed) as sampler:
        (base,), (teacher,), following = evals.base_checks(sampler, prompts,
                                                              {cfg.seed: splits}, n)
        examples, some = {}, splits["train"][:4]
        for family, (hint, replacement) in data.HELDOUT_HINTS.items():
            got = evals.answers(sampler, prompts, some, hint, n)
            examples[family] = [{"question": i.question, "answer": g,
                                 "want": data.under_hint(i.answer, replacement)}
                                for i, g in zip(some, got, strict=True)]
    gaps = evals.target_confidence(state.model(graphdef), tok, items)
    report = {"base": base, "teacher": teacher, "hint_following": following,
              "target_logit_gap": {"per_item": gaps, "median": float(np.median(gaps))},
              "examples": examples, "base_sft_s": t_sft, "final_loss": final_loss,
              "num_params": int(sum(x.size for x in jax.tree.leaves(state.params))),
              "config": cfg.to_dict()}
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "base_report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    log(f"base: {json.dumps(base)}\nteacher (base + target hint): {json.dumps(teacher)}\n"
        f"hint following: {json.dumps(following)}\n({t_sft:.0f} s base SFT)")
    for family, rows in examples.items():
        for r in rows:
            log(f"  {family}: {r['question']} -> {r['answer']}  (want: {r['want']})")
    return report


def main(argv):
    del argv
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    run(_CONFIG.value)


if __name__ == "__main__":
    from absl import app
    from ml_collections import config_flags

    _CONFIG = config_flags.DEFINE_config_file("config", "experiments/pinapple/config.py:faithful")
    app.run(main)
