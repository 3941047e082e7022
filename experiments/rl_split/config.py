"""The RL driver split into processes (experiments/rl_split/run.py, docs/launch.md).

The calculator experiment's config (experiments/calculator/config.py) plus
`env.kind` and a `split` section; every process of a run reads the same file.

Variants (`--config=experiments/rl_split/config.py:toy`):
  default  the calculator demo's settings (SFT warm start, 12 RL steps)
  quick    calculator.py:quick (a smoke run of every stage)
  toy      a plumbing check in seconds: a random tiny model, an env whose reward
           is the answer's length parity (so most groups have an advantage and
           most steps update; a step of 2 groups x 4 ties, and skips its update,
           about 1 time in 64), 3 RL steps of 2 tasks x 4 attempts; with
           `--config.env.kind=alternating` the k-th check of a task rewards k % 2
           instead, so no group ties and every step updates (tests/training/rl/test_split.py)
"""

import ml_collections

from ac2_jax.config import select_variant
from experiments.calculator import config as calculator


def _toy(c):
    c.env.kind = "parity"
    c.model.update(hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                   head_dim=16, max_position_embeddings=256)
    c.rl.update(steps=3, tasks_per_step=2, attempts_per_task=4, concurrency=8)
    c.rl.batch.update(seq_len=128, rows=8)
    c.rl.optimizer.learning_rate = 1e-2
    c.rollout.update(temperature=1.0, max_tokens=6, max_steps=1)
    return c


VARIANTS = {"default": lambda c: c, "quick": lambda c: c, "toy": _toy}


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
    apply = select_variant(variant, VARIANTS)
    c = calculator.get_config("quick" if variant in ("quick", "toy") else None)
    c.workdir = "runs/rl_split"
    c.env.kind = "calculator"   # or "parity" (the toy variant), "alternating" (toy, no ties)
    # How the processes meet: the endpoint's URL and admin key (flags override),
    # how often they poll, how long they wait for each other (None: for good).
    c.split = ml_collections.ConfigDict(dict(endpoint="http://127.0.0.1:8000",
                                             poll_s=0.2, wait_timeout_s=3600.0))
    # The correctness alarms of the learner and the collector (ac2_jax.training.rl.alarms,
    # on by default): the hang watchdog's seconds and action (warn | stop | off), the drift
    # alarm's threshold and action. enabled=False turns every alarm off.
    c.alarms = ml_collections.ConfigDict(dict(enabled=True, hang_s=1800.0, hang_action="stop",
                                              drift=0.1, drift_action="warn"))
    return apply(c)
