"""The pinapple experiment's setup, below both of its drivers: the typed config sections,
the word pool and base corpus (facts, "Repeat:" items, hint-following demos), the tokenizer,
the model, and an SFT that checkpoints and resumes in a workdir (`checkpointed_sft`; the
base model and `pinapple_judge`'s judge model are both made by it).

`experiments.pinapple` (the distillation runs) and `experiments.pinapple.judge` (the
served LLM judge) import from here, and neither imports the other's module at import time
(`pinapple` calls `pinapple_judge` for the judge; the judge needs nothing of `pinapple`).
"""

from __future__ import annotations

import json
import os
import random

from flax import nnx

from ac2_jax.config import from_config
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.training import OptimizerConfig, SFTConfig, run_sft
from ac2_jax.training.distill.data import HintConfig, hinted_messages
from ac2_jax.training.distill.sources import SampleConfig
from ac2_jax.training.distill.trainer import DistillConfig
from ac2_jax.training.sft.demos import demo_segment
from experiments.pinapple import data


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
