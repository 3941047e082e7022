"""The pinapple experiment: teach a spelling change only through hints (CPU, minutes).

Base SFT once (`seed`: tokenizer corpus, base model, distill/held-out split),
then for each of `seeds` and each method (SFT on hinted outputs, OPSD, RMSD)
a self-distillation run from that base model (the seed drives sampling and
prompt order). Held-out target rate every `target_every` steps, retention on
every `retain_every`-th item every `eval_every` steps, all items at the end.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.seeds = (0, 1, 2)
    c.workdir = "runs/pinapple"
    c.methods = ("sft", "opsd", "rmsd")

    c.tokenizer = ml_collections.ConfigDict(dict(vocab_size=512))
    c.model = ml_collections.ConfigDict(dict(
        hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=4,
        head_dim=16, max_position_embeddings=256))

    # Base SFT: facts (repeated) + hint-following demos for words other than pineapple.
    c.sft = ml_collections.ConfigDict(dict(
        repeats=3, hint_demos=3000, irrelevant_frac=0.3, target_hint_frac=0.15, math_limit=10,
        steps=1000, batch_rows=8, seq_len=128, learning_rate=5e-3, warmup_steps=30,
        placements=("before_turn",)))

    c.hint = ml_collections.ConfigDict(dict(placement="before_turn", template="{hint}"))

    c.distill = ml_collections.ConfigDict(dict(
        steps=60, prompts_per_step=8, learning_rate=2e-4, temperature=1.0, max_new_tokens=20,
        only_failures=False,
        kind="reverse_kl", teacher="live", ema_decay=0.9, top_t=2, threshold=None,
        judge="keywords", seq_len=128, rows=4, heldout_frac=0.35, target_rate=0.9,
        target_every=2, eval_every=10, retain_every=4))

    c.report = ml_collections.ConfigDict(dict(example_method="rmsd"))
    return c
