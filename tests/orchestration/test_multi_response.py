"""Multi-response branches: a selection policy, and unchosen branches never
trained on the continued branch's reward (issue 20 item 6)."""

import types

import numpy as np
import pytest

from ac2_jax.envs import Env, Task
from ac2_jax.orchestration import MultiResponseOrchestrator
from ac2_jax.trace import Completion, Trace, TraceRecorder
from ac2_jax.training.rl import BatchConfig, build_batch, unchosen_branch_episodes


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
    best.last_response_id = "chatcmpl-1"  # step() sets it from the response
    assert best.choose(choices).message.content == "4"
    assert best.trace.metrics["branch_choices"] == [{"request_id": "chatcmpl-1", "index": 1}]
    scored = MultiResponseOrchestrator(env, task, None, "m", n=3, select=lambda t: -len(t or ""))
    assert scored.choose(choices).message.content == "5"  # ties: the first


def _branched_trace(chosen):
    """Two requests with n=2: [1,2,3] -> 10 | 20, then the chosen branch + 5 -> 30 | 40."""
    t = Trace(task_id="t", attempt_id="0", group_id="g", reward=1.0, status="finished",
              metadata={"artifacts": {"metrics": {"branch_choices": [
                  {"request_id": f"r{k}", "index": c} for k, c in enumerate(chosen)]}}})
    rec = TraceRecorder(t)
    for k, prompt in enumerate(([1, 2, 3], [1, 2, 3, [10, 20][chosen[0]], 5])):
        for m, out in enumerate(([10], [20]) if k == 0 else ([30], [40])):
            rec.record("main", Completion(prompt, out, [-0.5], request_id=f"r{k}",
                                          choice_index=m))
    return t


@pytest.mark.parametrize("chosen,trained,unchosen", [
    ([0, 0], [10, 30], {1, 2}),  # episodes: [1,2,3,10,5,30], [1,2,3,20], [..,10,5,40]
    ([1, 1], [20, 40], {0}),     # [1,2,3,10], [1,2,3,20,5,30], [...,20,5,40]: 20 stays
    ([0, 1], [10, 40], {1}),     # [1,2,3,10,5,30] keeps 10, its 30 is masked
    ([1, 0], [20, 30], {0, 2})])
def test_the_continued_path_trains_once_and_only_it(chosen, trained, unchosen):
    t = _branched_trace(chosen)
    assert unchosen_branch_episodes(t) == unchosen
    other = Trace(task_id="t", attempt_id="1", group_id="g", reward=0.0, status="finished")
    TraceRecorder(other).record("main", Completion([1, 2, 3], [50], [-0.5]))
    for mode in ("episode", "request"):
        batch, stats, adv = build_batch([t, other], 0, BatchConfig(seq_len=16, segment_mode=mode))
        assert (stats.unchosen_responses, stats.unchosen_tokens) == (2, 2)
        got = np.asarray(batch.targets)[np.asarray(batch.loss_mask) > 0].tolist()
        assert sorted(got) == sorted(trained + [50]), mode
