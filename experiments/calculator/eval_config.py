"""Evals of calculator-agent checkpoints: K attempts per task, intervals, pass@k, cost.

    python -m experiments.calculator.evaluate --config=experiments/calculator/eval_config.py
    python -m experiments.calculator.evaluate --config=experiments/calculator/eval_config.py:toy

checkpoints: Orbax directories, evaluated in order on the same tasks and
seeds: a `save_params` directory (e.g. the demo's `sft_params`) or a
published-weights directory (e.g. the demo's `rl/published`; "dir@STEP" for
one step, the newest otherwise). None or () evaluates the freshly
initialized model. tokenizer.path: the run's saved tokenizer (None: build
it as the demo does, from seed, env and tokenizer.vocab_size). model, env,
tokenizer and seed default to the calculator demo's
(experiments/calculator/config.py), so its checkpoints load as they are.
prices: USD per million tokens (cached prompt, uncached prompt, output).
sampler.fixed_shapes: see JaxSampler.

Variants:
  default  the demo's SFT and RL checkpoints, 100 held-out tasks x 4 attempts
  toy      the initialized model, 3 tasks x 2 attempts in two domains (seconds)
"""

import ml_collections
from ml_collections import config_dict

from ac2_jax.config import select_variant
from experiments.calculator.config import get_config as calculator_config


def _default(c):
    return c


def _toy(c):
    c.checkpoints = ()
    c.tokenizer.path = None
    c.tokenizer.vocab_size = 400
    c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                   num_kv_heads=1, head_dim=16, max_position_embeddings=512)
    c.env.domains = ("calculator", "stepwise_calculator")
    c.eval.update(num_tasks=3, k=2, max_tokens=12, max_steps=2, concurrency=4,
                  temperature=1.0)
    c.sampler.fixed_shapes = True  # one set of compiles for the whole run
    c.report.progress = False
    return c


VARIANTS = {"default": _default, "toy": _toy}


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    apply = select_variant(variant, VARIANTS)
    demo = calculator_config()
    c = ml_collections.ConfigDict()
    c.seed = demo.seed
    c.workdir = "runs/evaluate"
    c.checkpoints = ("runs/calculator/sft_params", "runs/calculator/rl/published")
    c.tokenizer = ml_collections.ConfigDict(dict(path="runs/calculator/tokenizer",
                                                 vocab_size=demo.tokenizer.vocab_size))
    c.model = ml_collections.ConfigDict(demo.model.to_dict())   # DecoderConfig
    c.env = ml_collections.ConfigDict(dict(num_range=tuple(demo.env.num_range),
                                           answer_digits=demo.env.answer_digits,
                                           domains=("calculator",)))
    c.eval = ml_collections.ConfigDict(dict(
        num_tasks=100, split="eval", k=4, seed=0, level=0.95, temperature=0.3,
        max_tokens=demo.rollout.max_tokens, max_steps=demo.rollout.max_steps, concurrency=64,
        pass_threshold=1.0, infra_retries=2, infra_error="exclude",
        timeout_s=config_dict.placeholder(float)))
    # JaxSampler: fixed_shapes pads every batch to eval.concurrency rows (fewer compiles).
    c.sampler = ml_collections.ConfigDict(dict(fixed_shapes=False))
    c.prices = ml_collections.ConfigDict(dict(cached_input=0.20, uncached_input=2.00,
                                              output=8.00))
    c.report = ml_collections.ConfigDict(dict(progress=True, max_task_rows=100))
    return apply(c)
