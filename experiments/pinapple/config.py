"""The pinapple experiment: teach a spelling change only through hints (CPU, minutes).

Base SFT once (`seed`: tokenizer corpus, base model, distill/held-out split),
then for each of `data_seeds` (the split; default `seed`'s), each of `seeds`
and each method (SFT on hinted outputs, OPSD, RMSD) a self-distillation run
from that base model (the seed drives sampling and prompt order). Held-out target rate every `loop.target_every` steps,
retention on every `loop.retain_every`-th item every `loop.eval_every`
steps, all items at the end.

Sections named after a dataclass have exactly its fields (converted by
`ac2_jax.config.from_config`): model / judge_model -> DecoderConfig (vocab_size:
the tokenizer's), sft / judge_sft -> SFTConfig, sft_optimizer / distill_optimizer /
judge_optimizer -> OptimizerConfig, hint -> HintConfig, distill -> DistillConfig
(method: each of `methods`), sampling -> SampleConfig. The others are this
experiment's own: tokenizer, base_data, loop, judge_data, report.

Variants (`--config=experiments/pinapple/config.py:quick`):
  default  the reported experiment (3 seeds x 3 methods, 60 distillation steps)
  quick    a smoke run of every stage (one seed, a few steps)
  faithful issue 39: a base that never saw the target hint (8 seeds)
"""

import ml_collections
from ml_collections import config_dict

from ac2_jax.config import select_variant


def _default(c):
    return c


def _quick(c):
    c.seeds = (0,)
    c.base_data.update(repeats=1, hint_demos=200)
    c.sft.steps = 20
    c.sft_optimizer.warmup_steps = 2
    c.loop.update(steps=2, prompts_per_step=4, target_every=1, eval_every=2, retain_every=16)
    return c


def _faithful(c):
    """Issue 39's faithful setup: the base corpus never shows a held-out hint (the target
    hint "Spell pineapple as pinapple.", "Say papaya instead of pineapple.", "Write
    pineapple in capitals.") nor the target spelling. It teaches hint following by
    families (spell, swap, caps) over every answer word, 400 made-up ones and "Repeat:"
    items; spell and swap hints may name the target word with other replacements
    (`target_word_hints`), so that following the target hint is an in-context copy of
    a spelling the model never saw. Half the spell hints give a made-up word
    (`spell_fresh`), so that following one is a pure copy of the hint's word, and half the
    demos are on fact items (`fact_demo_frac`), where the target prompts are."""
    c.workdir = "runs/pinapple_faithful"
    c.seeds = tuple(range(8))
    c.tokenizer.vocab_size = 1024
    c.model.update(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                   num_kv_heads=4, head_dim=32)
    c.base_data.update(target_hint_frac=0.0, families=("spell", "swap", "caps"),
                       repeat_items=3000, nonce_words=400, hint_demos=40000,
                       target_word_hints=True, spell_edits=2, spell_fresh=0.5,
                       fact_demo_frac=0.5)
    c.sft.update(steps=10000, batch_rows=16, checkpoint_every=1000)
    c.sft_optimizer.update(learning_rate=3e-3, warmup_steps=100)
    # Answers run to ~25 tokens with this corpus's tokenizer: 20 cut some off.
    c.loop.answer_tokens = 32
    # This base is sure of "pineapple" (SFT loss ~0.0003): reverse KL's gradient vanishes
    # there, forward KL's does not (tests/losses/test_distill.py,
    # docs/notes/2026-12-06-rmsd-vs-opsd-faithful-analysis-judge-try4.md), and at
    # lr 2e-4 60 steps were too few for any method in the seed-0 probes.
    c.distill.kind = "forward_kl"
    c.loop.steps = 120
    c.sampling.max_new_tokens = 32
    return c


VARIANTS = {"default": _default, "quick": _quick, "faithful": _faithful}


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    apply = select_variant(variant, VARIANTS)
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.seeds = (0, 1, 2)
    # The second seed axis: the distill / held-out split of the target items, one per
    # data seed (every method x seed runs on each); empty: `seed`'s split only.
    c.data_seeds = ()
    c.workdir = "runs/pinapple"
    c.methods = ("sft", "opsd", "rmsd")

    c.tokenizer = ml_collections.ConfigDict(dict(vocab_size=512))
    c.model = ml_collections.ConfigDict(dict(   # DecoderConfig (vocab_size: the tokenizer's)
        hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=4,
        head_dim=16, max_position_embeddings=256, rope_theta=10000.0, tie_embeddings=True))

    # Base SFT data: facts (repeated) + hint-following demos for words other than pineapple.
    c.base_data = ml_collections.ConfigDict(dict(
        repeats=3, hint_demos=3000, irrelevant_frac=0.3, target_hint_frac=0.15, math_limit=10,
        placements=("before_turn",), families=(), repeat_items=0, nonce_words=0,
        target_word_hints=False, spell_edits=1, spell_fresh=0.0, fact_demo_frac=0.0))
    c.sft = ml_collections.ConfigDict(dict(   # SFTConfig
        steps=1000, batch_rows=8, seq_len=128, mode="token_mean", checkpoint_every=0))
    c.sft.seed = c.get_ref("seed")
    c.sft_optimizer = ml_collections.ConfigDict(dict(   # OptimizerConfig
        learning_rate=5e-3, warmup_steps=30, schedule="cosine"))
    c.sft_optimizer.total_steps = c.sft.get_ref("steps")

    c.hint = ml_collections.ConfigDict(dict(placement="before_turn", template="{hint}"))

    # The distillation loop: every step samples `prompts_per_step` distillation prompts.
    c.loop = ml_collections.ConfigDict(dict(
        steps=60, prompts_per_step=8, only_failures=False, judge="keywords", heldout_frac=0.35,
        target_rate=0.9, target_every=2, eval_every=10, retain_every=4, answer_tokens=20))
    c.distill = ml_collections.ConfigDict(dict(   # DistillConfig (method: each of `methods`)
        kind="reverse_kl", teacher="live", ema_decay=0.9, top_t=2,
        threshold=config_dict.placeholder(float), seq_len=128, rows=4))
    c.distill.groups = c.loop.get_ref("prompts_per_step")
    # S: at most this many judge selections per response (None: every relevant candidate).
    c.loop.judge_top_s = config_dict.placeholder(int)
    # RMSD's extra runs over T (distill.top_t), S (loop.judge_top_s), the judge
    # ("keywords", "diff", "noisy:<rate>", "llm") and the divergence (distill.kind):
    # every combination x every seed, after the main runs; an empty tuple keeps the main
    # runs' value, all empty: no sweep.
    c.sweep = ml_collections.ConfigDict(dict(top_t=(), top_s=(), judge=(), kind=()))
    c.distill_optimizer = ml_collections.ConfigDict(dict(learning_rate=2e-4))  # OptimizerConfig
    c.sampling = ml_collections.ConfigDict(dict(   # SampleConfig
        max_new_tokens=20, temperature=1.0))
    c.sampling.min_batch = c.loop.get_ref("prompts_per_step")

    # The LLM judge (judge "llm", `experiments/pinapple/judge.py`): a second small model
    # trained on the oracle's verdicts over other hints, served through the endpoint.
    c.judge_data = ml_collections.ConfigDict(dict(examples=6000, test_examples=200,
                                                  vocab_size=1024))
    # The most tokens of a served judge reply (how it is asked, not trained: not in the
    # judge's checkpoint fingerprint); a reply cut there is invalid, retried, then skipped.
    c.loop.judge_max_tokens = 24
    # The most held-out target-hint examples the judge's agreement is scored on, spread
    # over the target items (0: all, every target item x every held-out hint; scoring only,
    # not in the judge's checkpoint fingerprint).
    c.loop.judge_target_examples = 0
    c.judge_model = ml_collections.ConfigDict(dict(   # DecoderConfig (vocab: its tokenizer's)
        hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=4,
        head_dim=32, max_position_embeddings=512, rope_theta=10000.0, tie_embeddings=True))
    c.judge_sft = ml_collections.ConfigDict(dict(   # SFTConfig
        steps=2000, batch_rows=8, seq_len=384, mode="token_mean", checkpoint_every=500))
    c.judge_sft.seed = c.get_ref("seed")
    c.judge_optimizer = ml_collections.ConfigDict(dict(   # OptimizerConfig
        learning_rate=3e-3, warmup_steps=50, schedule="cosine"))
    c.judge_optimizer.total_steps = c.judge_sft.get_ref("steps")

    c.report = ml_collections.ConfigDict(dict(example_method="rmsd"))
    return apply(c)
