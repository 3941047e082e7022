"""segments_from_trace: the episode and request views of a trace."""

import numpy as np
import pytest

from ac2_jax.segments import Segment, segments_from_trace
from ac2_jax.trace import Completion, Trace, TraceRecorder


def _trace():
    t = Trace(task_id="t", attempt_id="1")
    rec = TraceRecorder(t)
    rec.record("main", Completion([1, 2, 3], [4, 5], [-0.5, -0.25], policy_version=1))
    rec.record("main", Completion([1, 2, 3, 4, 5, 6], [7], [-0.75], policy_version=2))
    rec.record("compactor", Completion([8, 9], [10], [-1.0], policy_version=2))
    return t


def test_episode_mode_one_segment_per_episode():
    segs = segments_from_trace(_trace(), mode="episode", advantage=0.5)
    assert len(segs) == 2
    main = segs[0]
    np.testing.assert_array_equal(main.tokens, [1, 2, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(main.loss_mask, [0, 0, 0, 1, 1, 0, 1])
    np.testing.assert_allclose(main.sampler_logprobs, [0, 0, 0, -0.5, -0.25, 0, -0.75])
    assert main.task == "t/1" and main.advantage == 0.5 and main.policy_version == 2
    assert segs[1].agent == "compactor"


def test_request_mode_one_segment_per_request():
    segs = segments_from_trace(_trace(), mode="request")
    assert len(segs) == 3
    np.testing.assert_array_equal(segs[1].tokens, [1, 2, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(segs[1].loss_mask, [0, 0, 0, 0, 0, 0, 1])
    # Same agent tokens overall, counted once per request.
    assert sum(s.num_agent_tokens for s in segs) == 4


def test_bad_mode_and_lengths():
    with pytest.raises(ValueError, match="mode"):
        segments_from_trace(_trace(), mode="turn")
    with pytest.raises(ValueError, match="length of tokens"):
        Segment([1, 2], [0], [0.0, 0.0], task="x")
