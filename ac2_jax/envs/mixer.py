"""Domain mixing: draw tasks from several envs with fixed weights.

Each domain samples with its own seed (derived from the mixer seed and the
domain name) and its task ids are prefixed "<domain>/", so two domains built
from the same env class never share tasks or task ids (ids key groups and
resume).
"""

from __future__ import annotations

import hashlib
import random

from ac2_jax.envs.base import Env, Task


def domain_seed(seed: int, domain: str) -> int:
    """A domain's seed: a fixed hash of (mixer seed, domain), stable across runs."""
    digest = hashlib.sha256(f"domain-seed:{seed}:{domain}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # non-negative 63-bit int


class DomainMixer:
    """Samples tasks across envs by weight; `env_for(task)` finds a task's env."""

    def __init__(self, envs: dict[str, Env], weights: dict[str, float] | None = None):
        if not envs:
            raise ValueError("DomainMixer needs at least one env")
        self.envs = dict(envs)
        weights = weights or {name: 1.0 for name in envs}
        unknown = set(weights) - set(envs)
        if unknown:
            raise ValueError(f"DomainMixer: weights for unknown envs {sorted(unknown)}")
        if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"DomainMixer: weights must be >= 0 with a positive sum: {weights}")
        self.weights = {name: float(weights.get(name, 0.0)) for name in envs}

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        rng = random.Random(f"mix:{split}:{seed}")
        names = list(self.envs)
        picks = rng.choices(names, weights=[self.weights[k] for k in names], k=n)
        tasks = []
        for name in names:
            k = picks.count(name)
            if k:
                for t in self.envs[name].sample_tasks(k, domain_seed(seed, name), split):
                    t.domain = name
                    t.task_id = f"{name}/{t.task_id}"
                    tasks.append(t)
        rng.shuffle(tasks)
        return tasks

    def env_for(self, task: Task) -> Env:
        return self.envs[task.domain]
