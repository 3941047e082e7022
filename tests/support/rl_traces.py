"""Shared by the RL data and batching tests: a one-request trace of one attempt."""

from ac2_jax.trace import Completion, Trace, TraceRecorder


def rl_trace(task, attempt, reward, version=0, status="finished", n_out=3) -> Trace:
    """Attempt `attempt` at `task` (group `g:<task>`): one main request, prompt [1, 2, 3],
    `n_out` agent tokens 10.. with log-prob -0.5, sampled by policy `version`."""
    t = Trace(task_id=task, attempt_id=str(attempt), group_id=f"g:{task}", reward=reward,
              status=status)
    TraceRecorder(t).record("main", Completion([1, 2, 3], list(range(10, 10 + n_out)),
                                               [-0.5] * n_out, policy_version=version))
    return t
