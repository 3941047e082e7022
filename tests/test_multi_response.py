"""Multi-response branches: a selection policy, and unchosen branches never
trained on the continued branch's reward (issue 20 item 6)."""

import asyncio
import types

import numpy as np

from ac2_jax.envs import Env, Task
from ac2_jax.orchestration import MultiResponseOrchestrator
from ac2_jax.trace import Completion, Trace, TraceRecorder
from ac2_jax.training.rl.data import BatchConfig, build_batch, unchosen_branch_episodes


class _Env(Env):
    def sample_tasks(self, n, seed, split="train"):
        return [Task(task_id="t", prompt="2+2?", answer="4")]

    def verify(self, task, answer):
        return float((answer or "").strip() == task.answer)


def _choice(text):
    return types.SimpleNamespace(message=types.SimpleNamespace(content=text, tool_calls=None),
                                 finish_reason="stop")


def test_best_of_n_picks_the_verified_branch():
    env = _Env()
    task = env.sample_tasks(1, 0)[0]
    first = MultiResponseOrchestrator(env, task, None, "m", n=3)
    best = MultiResponseOrchestrator(env, task, None, "m", n=3, select="verify")
    choices = [_choice("5"), _choice("4"), _choice("3")]
    assert first.choose(choices).message.content == "5"
    assert best.choose(choices).message.content == "4"
    assert best.trace.metrics["branch_choices"] == [1]
    scored = MultiResponseOrchestrator(env, task, None, "m", n=3, select=lambda t: -len(t or ""))
    assert scored.choose(choices).message.content == "5"  # ties: the first


def _branched_trace(chosen):
    """Two requests with n=2: [1,2,3] -> 10 | 20, then the chosen branch + 5 -> 30 | 40."""
    t = Trace(task_id="t", attempt_id="0", group_id="g", reward=1.0, status="finished",
              metadata={"artifacts": {"metrics": {"branch_choices": chosen}}})
    rec = TraceRecorder(t)
    rec.record("main", Completion([1, 2, 3], [10], [-0.5]))
    rec.record("main", Completion([1, 2, 3], [20], [-0.5]))
    first = [10, 20][chosen[0]]
    rec.record("main", Completion([1, 2, 3, first, 5], [30], [-0.5]))
    rec.record("main", Completion([1, 2, 3, first, 5], [40], [-0.5]))
    return t


def test_unchosen_branches_get_no_reward_in_a_built_batch():
    t = _branched_trace([1, 1])
    # episodes: [1,2,3,10] (unchosen), [1,2,3,20,5,30] (unchosen at step 2), [..., 40] (chosen)
    assert unchosen_branch_episodes(t) == {0, 1}
    other = Trace(task_id="t", attempt_id="1", group_id="g", reward=0.0, status="finished")
    TraceRecorder(other).record("main", Completion([1, 2, 3], [50], [-0.5]))
    batch, stats, adv = build_batch([t, other], 0, BatchConfig(seq_len=16))
    assert stats.unchosen_branches == 2
    trained = np.asarray(batch.targets)[np.asarray(batch.loss_mask) > 0].tolist()
    assert 10 not in trained and 30 not in trained and 40 in trained and 50 in trained
    # Without branch_choices ("first"): the first-recorded member of each group continues.
    t0 = _branched_trace([0, 0])
    t0.metadata = {}
    assert unchosen_branch_episodes(t0) == {1, 2}
