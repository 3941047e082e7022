"""An LLM judge for RMSD: a second small model trained to judge, served through the endpoint.

RMSD keeps the top-T divergence positions that a judge calls relevant to the hint. In
the pinapple experiment the oracle is a rule (`RuleJudge` on the hint's words). Issue 39
asks how RMSD depends on judge quality with an LLM judge too; here that judge is a small
decoder trained for the job, served by the library's OpenAI-compatible endpoint
(`build_app`, under a rollout of the lifecycle API), and asked through the real `openai`
client by `LLMJudge`, exactly as a large served judge would be.

The judge's data: `judge_examples` builds `JudgeExample`s from the pinapple corpus, the
way RMSD meets them. The response is an item's un-hinted answer (the student's), in the
policy's tokens; the hint is a family hint (spell / swap / caps, about a word of the
answer or not); the candidates are 1-4 response positions, the hinted word's tokens
first when the hint names one (divergence puts them first), the rest at random. The label
is the oracle's selection, the reply its JSON (`{"relevant": [...]}`), the prompt
`LLMJudge.messages`. No judge example has a hint about the target word, so judging the
target hint is as new to the judge as following it is to the base.

    judge = train_judge(cfg, policy_tokenizer, items, pool, workdir, log)
    with served_judge(judge, workdir) as make:      # make(top_s) -> LLMJudge
        agreement(make(None), heldout_examples)     # against the oracle

Alone (train, serve, score; `pinapple.run` then restores the judge from the workdir):

    python -m experiments.pinapple.judge --config=experiments/pinapple/config.py:faithful
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import secrets

from ac2_jax.envs.judges import JudgeExample, LLMJudge, RuleJudge
from experiments.pinapple import data
from experiments.pinapple.common import (
    build_tokenizer,
    checkpointed_sft,
    corpus_items,
    fingerprint,
    word_pool,
)

MODEL_NAME = "pinapple-judge"
# The config sections that make the judge (its data comes from the base corpus's items).
JUDGE_SECTIONS = ("seed", "tokenizer", "base_data", "judge_data", "judge_model", "judge_sft",
                  "judge_optimizer")


def oracle() -> RuleJudge:
    """The judge the LLM judge learns from and is scored against: the hint's words."""
    return RuleJudge(use_hint_keywords=True)


def response_tokens(tokenizer, answer: str) -> tuple[list[int], tuple[str, ...]]:
    """A response as the policy samples it: the answer's tokens and the stop token, with
    each token's text as the trainer shows it to a judge (`tokenizer.decode([t])`)."""
    ids = tokenizer.encode(answer) + [tokenizer.eos_token_id]
    return ids, tuple(tokenizer.decode([t]) for t in ids)


def judge_example(tokenizer, item: data.Item, hint: str, rng: random.Random,
                  max_candidates: int = 4) -> JudgeExample:
    """One example of `hint` on `item`'s un-hinted answer: 1-`max_candidates` candidates,
    the positions the oracle selects first (in a random order) when there are any, then
    other positions at random (their order is the divergence ranking RMSD would give)."""
    _, toks = response_tokens(tokenizer, item.answer)
    prompt = tokenizer.decode(tokenizer.apply_chat_template(list(item.messages()),
                                                            tokenize=True))
    every = JudgeExample(prompt=prompt, response=item.answer, response_tokens=toks, hint=hint,
                         candidates=tuple(range(len(toks))))
    hits = oracle().select(every)
    rng.shuffle(hits)
    k = rng.randint(1, min(max_candidates, len(toks)))
    rest = [p for p in range(len(toks)) if p not in hits]
    rng.shuffle(rest)
    first = hits[: rng.randint(1, k)] if hits else []
    cands = first + rest[: k - len(first)]
    return dataclasses.replace(every, candidates=tuple(cands))


def example_key(e: JudgeExample) -> tuple:
    """What makes two judge examples the same question: prompt, hint, response."""
    return (e.prompt, e.hint, e.response)


def judge_examples(tokenizer, items, pool, n: int, seed: int, relevant_frac: float = 0.7,
                   facts_frac: float = 0.5, exclude: set | None = None) -> list[JudgeExample]:
    """`n` examples over `items` (`facts_frac` of them on fact items, the rest on any item,
    "Repeat:" ones included) with family hints about a word of the answer (`relevant_frac`
    of them) or another word of `pool`; never a hint about the target word. exclude:
    `example_key`s never drawn (a test set apart from the training examples)."""
    rng, out = random.Random(f"judge:{seed}"), []
    pool = [w for w in pool if w != data.TARGET_WORD]
    facts = [i for i in items if i.kind != "repeat"]
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n + 1000:
            raise ValueError(f"judge_examples: only {len(out)} of {n} examples outside the "
                             f"{len(exclude or ())} excluded ones; the corpus is too small")
        item = rng.choice(facts if rng.random() < facts_frac else items)
        demo = data.family_hint_demo(item, rng, rng.random() < relevant_frac,
                                     rng.choice(data.FAMILIES), pool)
        if demo is not None:
            e = judge_example(tokenizer, item, demo[0], rng)
            if not exclude or example_key(e) not in exclude:
                out.append(e)
    return out


def target_examples(tokenizer, items, seed: int) -> list[JudgeExample]:
    """The judge's held-out test: the target hint on every target item's un-hinted answer,
    as the distillation meets it (plus the held-out swap and caps hints)."""
    rng = random.Random(f"judge-target:{seed}")
    hints = [h for h, _ in data.HELDOUT_HINTS.values()]
    return [judge_example(tokenizer, it, h, rng) for it in items if it.kind == "target"
            for h in hints]


def spread(examples: list, n: int) -> list:
    """`n` of `examples` evenly spaced from the first (all of them when n is 0 or more
    than there are)."""
    if n < 0:
        raise ValueError(f"pinapple_judge: loop.judge_target_examples must be >= 0, got {n}")
    if not n or n >= len(examples):
        return list(examples)
    return [examples[i * len(examples) // n] for i in range(n)]


def reply(example: JudgeExample) -> str:
    """The oracle's answer as the judge is asked to write it."""
    return json.dumps({"relevant": oracle().select(example)})


def judge_messages(example: JudgeExample) -> list[dict]:
    """The request `LLMJudge` sends for `example` (system + user)."""
    return LLMJudge(client=None, model=MODEL_NAME).messages(example)


@dataclasses.dataclass
class TrainedJudge:
    graphdef: object
    state: object
    tokenizer: object
    final_loss: float | None
    max_context: int
    trained_on: frozenset = frozenset()  # `example_key`s of its training examples


def train_judge(cfg, policy_tokenizer, items, pool, workdir: str, log=print) -> TrainedJudge:
    """Trains the judge (`cfg.judge_model`, `cfg.judge_sft`, `cfg.judge_data`) on
    `judge_examples`, with its own tokenizer; checkpoints in `workdir` and resumes there
    (`pinapple_setup.checkpointed_sft`; the sections of `JUDGE_SECTIONS` make it)."""
    from flax import nnx

    from ac2_jax.config import from_config
    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
    from ac2_jax.training import OptimizerConfig, SFTConfig
    from ac2_jax.training.sft.demos import demo_segment

    jd = cfg.judge_data
    examples = judge_examples(policy_tokenizer, items, pool, jd.examples, cfg.seed)
    convs = [judge_messages(e) + [{"role": "assistant", "content": reply(e)}] for e in examples]
    corpus = [m["content"] for c in convs[:2000] for m in c]
    corpus += [m["content"] for e in target_examples(policy_tokenizer, items, cfg.seed)
               for m in judge_messages(e)]  # the target hint's words are in its vocabulary
    tok = build_tiny_tokenizer(os.path.join(workdir, "tokenizer"), extra_corpus=corpus,
                               vocab_size=jd.vocab_size, individual_digits=True)
    segs = [demo_segment(tok, c, task=f"judge/{k}") for k, c in enumerate(convs)]
    longest = max(len(s.tokens) for s in segs)
    sft = from_config(SFTConfig, cfg.judge_sft, path="judge_sft")
    if longest > sft.seq_len:
        raise ValueError(f"pinapple_judge: a judge demo has {longest} tokens, more than "
                         f"judge_sft.seq_len={sft.seq_len}; raise it (and "
                         "judge_model.max_position_embeddings)")
    model = Decoder(from_config(DecoderConfig, cfg.judge_model, path="judge_model",
                                vocab_size=tok.vocab_size), rngs=nnx.Rngs(cfg.seed))
    opt = from_config(OptimizerConfig, cfg.judge_optimizer, path="judge_optimizer")
    log(f"judge: {len(segs)} demos, longest {longest} tokens, {tok.vocab_size}-token vocab")
    graphdef, state, final = checkpointed_sft("judge", model, segs, sft, opt, workdir,
                                              fingerprint(cfg, JUDGE_SECTIONS), log)
    return TrainedJudge(graphdef, state, tok, final, cfg.judge_model.max_position_embeddings,
                        frozenset(example_key(e) for e in examples))


@contextlib.contextmanager
def served_judge(judge: TrainedJudge, workdir: str, max_tokens: int = 24):
    """Serves the judge through the endpoint and yields `make(top_s) -> LLMJudge`, each
    asking it through the `openai` client under one rollout of the lifecycle API (its
    requests' traces go to `workdir/judge_traces.jsonl`). Greedy replies of at most
    `max_tokens` tokens; a bad reply is retried, then skipped and counted (`LLMJudge`)."""
    import openai

    from ac2_jax.orchestration import LifecycleClient
    from ac2_jax.sampling.engine.jax_sampler import JaxSampler
    from ac2_jax.serving.app import build_app
    from ac2_jax.serving.server import serve_in_thread

    def lifecycle(call):  # one short-lived client per call: asyncio.run closes its loop
        async def go():
            lc = LifecycleClient(base_url, admin)
            try:
                return await call(lc)
            finally:
                await lc.aclose()

        return asyncio.run(go())

    admin, tok = secrets.token_hex(8), judge.tokenizer
    eos = [i for i in (tok.eos_token_id, tok.pad_token_id) if i is not None]
    with JaxSampler(judge.state.model(judge.graphdef), max_batch=8, min_batch=1,
                    max_context=judge.max_context, eos_token_ids=eos) as sampler:
        app = build_app(sampler, tok, admin_key=admin, model_name=MODEL_NAME,
                        trace_store=os.path.join(workdir, "judge_traces.jsonl"))
        base_url, stop = serve_in_thread(app)
        try:
            r = lifecycle(lambda lc: lc.create("judge"))
            client = openai.OpenAI(base_url=r["base_url"], api_key=r["api_key"])
            try:
                yield lambda top_s=None: LLMJudge(client, MODEL_NAME, top_s=top_s,
                                                  max_tokens=max_tokens, on_error="skip")
            finally:
                client.close()
                lifecycle(lambda lc: lc.finish(r["rollout_id"], reward=0.0))
        finally:
            stop()


def agreement(judge, examples) -> dict:
    """The judge against the oracle on `examples`: exact (the same selection), precision
    and recall over selected positions, and the judge's counters (skips, bad replies)."""
    ref = oracle()
    exact, tp, fp, fn = 0, 0, 0, 0
    for e in examples:
        want, got = set(ref.select(e)), set(judge.select(e))
        exact += want == got
        tp, fp, fn = tp + len(want & got), fp + len(got - want), fn + len(want - got)
    return {"examples": len(examples), "exact": exact / max(len(examples), 1),
            "precision": tp / (tp + fp) if tp + fp else float("nan"),
            "recall": tp / (tp + fn) if tp + fn else float("nan"),
            "stats": dict(judge.stats)}


def start_llm_judge(cfg, tokenizer, items, workdir, stack, log):
    """Trains (or restores, `workdir/judge`) and serves the LLM judge for the run, entered
    on `stack`. Returns (`pinapple.make_judge`'s llm, the judge's agreement with the oracle on
    held-out examples of other hints and on the held-out hints about the target word)."""
    jdir = os.path.join(workdir, "judge")
    corpus, pool = corpus_items(cfg, items), word_pool(cfg, items)
    judge = train_judge(cfg, tokenizer, corpus, pool, jdir, log)
    llm = stack.enter_context(served_judge(judge, jdir, cfg.loop.get("judge_max_tokens", 24)))
    # Held out: examples of other hints drawn with another seed, none of them a training one.
    tests = {"other_hints": judge_examples(tokenizer, corpus, pool,
                                           cfg.judge_data.test_examples, cfg.seed + 1,
                                           exclude=judge.trained_on),
             "target_hints": spread(target_examples(tokenizer, items, cfg.seed),
                                    cfg.loop.get("judge_target_examples", 0))}
    meta = {"final_loss": judge.final_loss,
            **{k: agreement(llm(None), v) for k, v in tests.items()}}
    log(f"llm judge vs the oracle: {json.dumps(meta)}")
    return llm, meta


def run(cfg, log=print) -> dict:
    """Trains the judge for `cfg`'s corpus (in `workdir/judge`, where `pinapple.run`
    restores it), serves it and scores it against the oracle: `judge_report.json`."""
    import time

    t0 = time.perf_counter()
    workdir = os.path.abspath(cfg.workdir)
    items = data.all_items(cfg.base_data.math_limit)
    tok = build_tokenizer(cfg, os.path.join(workdir, "tokenizer"), items)
    with contextlib.ExitStack() as stack:
        _, meta = start_llm_judge(cfg, tok, items, workdir, stack, log)
    meta["wall_s"] = time.perf_counter() - t0
    with open(os.path.join(workdir, "judge", "judge_report.json"), "w") as f:
        json.dump(meta, f, indent=1, default=str)
    return meta


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
