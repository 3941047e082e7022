"""Toy envs for plumbing checks (a random tiny model can earn their rewards).

Its own module, free of absl flags, so tests import the env the experiments
run (`experiments.rl_split` defines its flags when imported).
"""

from __future__ import annotations

from ac2_jax.envs import Env, Task


class LengthParityEnv(Env):
    """Reward 1 when the answer has an even number of characters: a random policy
    earns it about half the time, so most groups of attempts have a reward spread
    (non-zero advantages) and most steps update. Not all: a group of G attempts ties
    with probability 2^(1-G) at a fair coin, so a step of n groups updates nothing
    with probability 2^(n(1-G)) (1/64 at 2 groups of 4). Task ids are
    `<split>-<seed>-<i>`: a step that draws with its own seed gets its own tasks."""

    def sample_tasks(self, n, seed, split="train"):
        return [Task(task_id=f"{split}-{seed}-{i}", prompt=f"Say something ({seed}/{i}).")
                for i in range(n)]

    def verify(self, task, answer):
        return float(len(answer or "") % 2 == 0)
