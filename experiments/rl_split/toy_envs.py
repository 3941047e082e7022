"""Toy envs for plumbing checks (a random tiny model can earn their rewards).

Its own module, free of absl flags, so tests import the env the experiments
run (`experiments.rl_split` defines its flags when imported).
"""

from __future__ import annotations

import collections

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


class AlternatingEnv(LengthParityEnv):
    """LengthParityEnv's tasks (ids by seed: a restarted collector draws the same ones),
    but the k-th verification of a task by this instance rewards k % 2, whatever the
    answer. For tests that need every step to update: any two attempts of a task
    verified by one instance in a row differ, so no group of G >= 2 ties (with the
    length-parity reward a step of 2 groups x 4 tied 1 time in 64: no update).

    The count lives in the instance, so in the collector's process: a collector killed
    and restarted mid-step starts again at k = 1 for the attempts it still runs (a
    shared count would be a channel between processes the split driver does not have).
    One kill still leaves no group of 4 tied (tests/training/rl/test_split.py): the restarted
    process runs m of the group's attempts with k = 1..m (rewards 1, 0, ...), mixed
    when m >= 2; when m <= 1 the killed one stored 4 - m >= 3 attempts with distinct
    k in 1..4, which hold both parities. (Several kills, or an attempt verified again
    after an infra error, can tie a group.)"""

    def __init__(self):
        self.verified: collections.Counter[str] = collections.Counter()

    def verify(self, task, answer):
        self.verified[task.task_id] += 1
        return float(self.verified[task.task_id] % 2)
