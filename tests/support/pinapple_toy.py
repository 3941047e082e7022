"""The pinapple study's faithful base at toy size, shared by tests/experiments/
test_pinapple.py and test_pinapple_base.py: the same model, corpus, tokenizer, SFT
steps and schedule, so the run's compilation cache serves the base's SFT step and
sampler programs once to both files."""

from experiments.pinapple.config import get_config


def toy_base_config():
    """`get_config("faithful")` with the toy model and base data (seeds, loop and
    sampling as the variant has them)."""
    cfg = get_config("faithful")
    cfg.model.update(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                     num_kv_heads=2, head_dim=16)
    cfg.base_data.update(repeat_items=20, nonce_words=20, hint_demos=100, math_limit=3)
    cfg.tokenizer.vocab_size = 400
    cfg.sft.update(steps=10, checkpoint_every=0)
    cfg.sft_optimizer.warmup_steps = 2
    return cfg
