"""The toy envs of the plumbing checks (experiments/rl_split/toy_envs.py)."""

from __future__ import annotations

import itertools

from experiments.rl_split.toy_envs import AlternatingEnv, LengthParityEnv


def test_length_parity_rewards_even_answers_and_draws_tasks_by_seed():
    env = LengthParityEnv()
    tasks = env.sample_tasks(2, seed=7)
    assert [t.task_id for t in tasks] == ["train-7-0", "train-7-1"]
    assert [t.task_id for t in env.sample_tasks(2, seed=7)] == ["train-7-0", "train-7-1"]
    assert [env.verify(tasks[0], a) for a in ("ab", "abc", "", None)] == [1.0, 0.0, 1.0, 1.0]


def test_alternating_rewards_the_kth_check_of_each_task_k_mod_2():
    env = AlternatingEnv()
    a, b = env.sample_tasks(2, seed=0)
    assert a.task_id == LengthParityEnv().sample_tasks(1, seed=0)[0].task_id
    got = [env.verify(a, "ab"), env.verify(a, "ab"), env.verify(b, "x"), env.verify(a, None),
           env.verify(b, "x"), env.verify(a, "abc")]
    assert got == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]  # whatever the answer; counts per task


def _group_after_one_kill(verified: int, stored: tuple[int, ...], attempts: int = 4):
    """Rewards of one group of `attempts` when a collector process verified `verified`
    of them, stored those with the k in `stored`, was killed, and a fresh process (a new
    AlternatingEnv) ran the rest: what tests/training/rl/test_split.py's SIGKILL can leave."""
    task = AlternatingEnv().sample_tasks(1, seed=0)[0]
    killed, restarted = AlternatingEnv(), AlternatingEnv()
    rewards = {k: killed.verify(task, "") for k in range(1, verified + 1)}
    kept = [rewards[k] for k in stored]
    return kept + [restarted.verify(task, "") for _ in range(attempts - len(stored))]


def test_one_kill_of_the_collector_never_ties_a_group_of_four():
    """Every way one kill can split a group of 4: the killed process verified v <= 4
    attempts and stored any subset of them (an attempt can be verified and not yet
    appended); the restarted process runs the others with its own count from 1."""
    cases = 0
    for verified in range(5):
        for n in range(verified + 1):
            for stored in itertools.combinations(range(1, verified + 1), n):
                rewards = _group_after_one_kill(verified, stored)
                assert len(rewards) == 4 and len(set(rewards)) == 2, (verified, stored, rewards)
                cases += 1
    assert cases == 1 + 2 + 4 + 8 + 16


def test_three_kills_can_tie_a_group():
    """The limit the docstring states: each process's count starts at 1, so four
    processes that each run one attempt of a group all earn 1."""
    task = AlternatingEnv().sample_tasks(1, seed=0)[0]
    assert [AlternatingEnv().verify(task, "") for _ in range(4)] == [1.0] * 4
