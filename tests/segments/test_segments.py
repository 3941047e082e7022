"""segments_from_trace: the episode and request views of a trace."""

import numpy as np
import pytest

from ac2_jax.segments import SAMPLER_LOGPROBS, Segment, segments_from_trace
from ac2_jax.trace import Completion, Trace, TraceRecorder


def _trace():
    t = Trace(task_id="t", attempt_id="1")
    rec = TraceRecorder(t)
    rec.record("main", Completion([1, 2, 3], [4, 5], [-0.5, -0.25], policy_version=1))
    rec.record("main", Completion([1, 2, 3, 4, 5, 6], [7], [-0.75], policy_version=2))
    rec.record("compactor", Completion([8, 9], [10], [-1.0], policy_version=2))
    return t


def test_episode_mode_one_segment_per_episode():
    segs = segments_from_trace(_trace(), mode="episode")
    assert len(segs) == 2
    main = segs[0]
    np.testing.assert_array_equal(main.tokens, [1, 2, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(main.loss_mask, [0, 0, 0, 1, 1, 0, 1])
    # The trace's recorded log-probs are the one feature a cut carries (RL adds advantages).
    assert list(main.features) == [SAMPLER_LOGPROBS]
    np.testing.assert_allclose(main.features[SAMPLER_LOGPROBS], [0, 0, 0, -0.5, -0.25, 0, -0.75])
    assert main.task == "t/1"
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
        Segment([1, 2], [0], task="x")


def test_features_are_per_token_numbers_checked_by_name():
    s = Segment([1, 2, 3], [0, 1, 1], task="x", features={"a": [1, 2, 3], "b": [0.5, 0, 0]})
    assert s.features["a"].dtype == np.int32 and s.features["b"].dtype == np.float32
    assert s.with_features(c=np.zeros(3)).features.keys() == {"a", "b", "c"}
    assert s.features.keys() == {"a", "b"}  # with_features copies
    with pytest.raises(ValueError, match=r"features\['a'\]\": 2"):
        Segment([1, 2, 3], [0, 1, 1], task="x", features={"a": [1, 2]})
    with pytest.raises(ValueError, match=r"features\['a'\] must be one value per token"):
        Segment([1, 2, 3], [0, 1, 1], task="x", features={"a": np.zeros((3, 2))})
    with pytest.raises(ValueError, match=r"features\['a'\] must be numbers"):
        Segment([1, 2, 3], [0, 1, 1], task="x", features={"a": ["p", "q", "r"]})
    with pytest.raises(TypeError):  # the old positional sampler_logprobs is refused loudly
        Segment([1, 2], [0, 1], [0.0, 0.0], task="x")
