"""The pinapple experiment's evals (greedy, through a `JaxSampler`): the held-out target
rate and retention (`evaluate`), whether a base follows the held-out hints
(`hint_following`, `base_checks`), how sure it is of the target word
(`target_confidence`), and the grader of the distillation's rollouts (`grade`)."""

from __future__ import annotations

import random

import jax
import numpy as np

from ac2_jax.training.distill.sources import HintTask, PromptCache, SampleConfig, sample
from experiments.pinapple import data


def make_splits(cfg, items, seed: int) -> dict:
    train, heldout = data.target_split(items, cfg.loop.heldout_frac, seed)
    retain = {k: [i for i in items if i.kind == k and data.TARGET_WORD not in i.answer]
              for k in ("food", "sentence", "other", "math")}
    return {"train": train, "heldout": heldout, "retain": retain}


def has_target(text: str) -> bool:
    t = text.lower()
    return data.TARGET_SPELLING in t and data.TARGET_WORD not in t


def grade(task: HintTask, text: str) -> str | None:
    """Passes (None) a response with the target spelling and not the old one; else the hint."""
    return None if has_target(text) else data.TARGET_HINT


def answers(sampler, prompts: PromptCache, items, hint: str | list[str] | None = None,
            max_new: int = 20) -> list[str]:
    """Greedy answers (text) of the sampler's policy to items, optionally with the hint
    (one for all, or a list: one per item)."""
    tasks = [HintTask(i.key, i.messages()) for i in items]
    hints = [hint] * len(tasks) if hint is None or isinstance(hint, str) else list(hint)
    ctx = [prompts.student(t) if h is None else prompts(t, h)[1]
           for t, h in zip(tasks, hints, strict=True)]
    outs = sample(sampler, ctx, SampleConfig(max_new_tokens=max_new, temperature=0.0),
                  stop_token_ids=prompts.tokenizer.stop_token_ids)
    return [prompts.tokenizer.decode(r.output_ids, skip_special_tokens=True).strip()
            for r in outs]


def evaluate(sampler, prompts, splits, retain_every: int | None = 1,
             hint: str | None = None, max_new: int = 20) -> dict[str, float]:
    """Greedy evals of the sampler's policy. target: held-out target rate (has
    "pinapple", no "pineapple"); target_exact: the whole answer right with the new
    spelling; target_train: rate on the distillation prompts; retention: exact answers
    on non-target items (every `retain_every`-th of each group; None: skip) and per
    group."""
    retain = ({} if retain_every is None else
              {k: v[::retain_every] for k, v in splits["retain"].items()})
    groups = {"heldout": splits["heldout"], "train": splits["train"], **retain}
    flat = [i for g in groups.values() for i in g]
    got = dict(zip([i.key for i in flat], answers(sampler, prompts, flat, hint, max_new)))
    want = lambda i: i.answer.replace(data.TARGET_WORD, data.TARGET_SPELLING)  # noqa: E731
    out = {"target": float(np.mean([has_target(got[i.key]) for i in groups["heldout"]])),
           "target_exact": float(np.mean([got[i.key] == want(i) for i in groups["heldout"]])),
           "target_train": float(np.mean([has_target(got[i.key]) for i in groups["train"]]))}
    keep = []
    for name, g in retain.items():
        ok = [got[i.key] == i.answer for i in g]
        out[f"retain_{name}"] = float(np.mean(ok))
        keep += ok
    if keep:
        out["retention"] = float(np.mean(keep))
    return out


def hint_following(sampler, prompts: PromptCache, splits, max_new: int = 20
                   ) -> dict[str, float]:
    """Does the model follow hints it never saw? Per held-out hint (`HELDOUT_HINTS`, one per
    family, each about the target word) the share of target prompts (distillation and
    held-out) answered exactly as the hint makes the answer, and of the retention items
    (no target word) answered unchanged under the target hint."""
    target = splits["train"] + splits["heldout"]
    out = {}
    for family, (hint, replacement) in data.HELDOUT_HINTS.items():
        got = answers(sampler, prompts, target, hint, max_new)
        out[family] = float(np.mean([g == data.under_hint(i.answer, replacement)
                                     for g, i in zip(got, target)]))
    others = [i for g in splits["retain"].values() for i in g]
    got = answers(sampler, prompts, others, data.TARGET_HINT, max_new)
    out["unchanged_elsewhere"] = float(np.mean([g == i.answer for g, i in zip(got, others)]))
    # The skill itself on words hints do name: a spell hint about another word of the
    # answer, with a misspelling drawn afresh (not one the corpus showed, but for chance).
    rng = random.Random(12345)
    demos = [(i, data.family_hint_demo(i, rng, True, "spell", [])) for i in others]
    demos = [(i, d) for i, d in demos if d is not None]
    got = answers(sampler, prompts, [i for i, _ in demos], [d[0] for _, d in demos], max_new)
    out["spell_other_words"] = float(np.mean([g == d[1] for g, (_, d) in zip(got, demos)]))
    return out


def target_confidence(model, tokenizer, items, n: int = 12) -> list[float]:
    """How sure the un-hinted model is of the target word where its answers have it: for
    the first `n` target items, log p(target word) minus the runner-up's log-prob at that
    position, teacher-forced on the answer (nats; negative when it is not the argmax).
    Reverse KL's gradient there falls like exp(-gap) (tests/losses/test_distill.py).
    One jitted forward of every item at once (rows padded after their tokens, segment 0:
    the causal model reads the position before the target from the tokens before it)."""
    import jax.numpy as jnp
    from flax import nnx

    word = tokenizer.encode(" " + data.TARGET_WORD)[0]
    rows = []
    for it in [i for i in items if i.kind == "target"][:n]:
        ans = tokenizer.encode(it.answer)
        ids = tokenizer.apply_chat_template(list(it.messages()), tokenize=True)
        rows.append(ids + ans[: ans.index(word)])
    if not rows:
        return []
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), np.int32)
    segs = np.zeros((len(rows), width), np.int32)
    for r, row in enumerate(rows):
        ids[r, : len(row)], segs[r, : len(row)] = row, 1
    last = np.array([len(r) - 1 for r in rows], np.int32)
    graphdef, state = nnx.split(model)

    @jax.jit
    def gaps_of(state, ids, segs, last):
        out = nnx.merge(graphdef, state)(ids, jnp.broadcast_to(jnp.arange(width), ids.shape), segs)
        logits = (out[0] if isinstance(out, tuple) else out)[jnp.arange(ids.shape[0]), last]
        lp = jax.nn.log_softmax(logits, axis=-1)
        return lp[:, word] - lp.at[:, word].set(-jnp.inf).max(axis=-1)

    return [float(g) for g in np.asarray(gaps_of(state, ids, segs, last))]


def base_checks(sampler, prompts, all_splits: dict, max_new: int):
    """The base before any distillation: per split, its greedy evals without a hint and
    under the target hint (the teacher), and `hint_following` on the first split."""
    base = [evaluate(sampler, prompts, sp, max_new=max_new) for sp in all_splits.values()]
    teacher = [evaluate(sampler, prompts, sp, hint=data.TARGET_HINT, max_new=max_new)
               for sp in all_splits.values()]
    following = hint_following(sampler, prompts, next(iter(all_splits.values())), max_new)
    return base, teacher, following
