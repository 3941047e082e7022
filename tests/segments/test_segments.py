"""segments_from_trace: the episode and request views of a trace."""

import numpy as np
import pytest

from ac2_jax.segments import (
    CONSTRAINT_ID,
    SAMPLER_LOGPROBS,
    FitCounts,
    Segment,
    fit_segments,
    segments_from_trace,
    unpack_mask_bits,
)
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


def test_fit_segments_counts_cut_and_unpredicted_agent_tokens():
    """fit_segments keeps each segment's first max_len tokens and counts what the cut
    took from the loss, and the agent tokens at position 0 of a segment: no prediction
    scores them (nothing precedes them), so the packed loss_mask never counts them."""
    segs = [Segment([1, 2, 3, 4, 5], [1, 1, 0, 1, 1], task="a"),
            Segment([6, 7], [0, 1], task="b"),
            Segment([8, 9], [1, 0], task="c")]
    out, counts = fit_segments(segs, 3)
    assert [len(s) for s in out] == [3, 2, 2]
    np.testing.assert_array_equal(out[0].tokens, [1, 2, 3])
    assert counts == FitCounts(truncated_segments=1, truncated_agent_tokens=2,
                               unpredicted_agent_tokens=2)


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


# -- grammar-constrained completions (Completion.constraint): their masks ride along


def _constrained_trace():
    """main: a free request (4 5), then a constrained one (7 8) and the compactor's
    constrained one (10)."""
    t = Trace(task_id="t", attempt_id="1")
    rec = TraceRecorder(t)
    rec.record("main", Completion([1, 2, 3], [4, 5], [-0.5, -0.25]))
    rec.record("main", Completion([1, 2, 3, 4, 5, 6], [7, 8], [-0.1, 0.0], constraint="g"))
    rec.record("compactor", Completion([8, 9], [10], [-1.0], constraint="g"))
    return t


V = 12


def _masks_of(c):
    """A hand-made mask per output token: the token itself and token 11."""
    m = np.zeros((len(c.output_ids), V), bool)
    m[np.arange(len(c.output_ids)), c.output_ids] = True
    m[:, 11] = True
    return m


@pytest.mark.parametrize("mode", ["episode", "request"])
def test_constrained_tokens_carry_their_masks(mode):
    segs = segments_from_trace(_constrained_trace(), mode=mode, constraint_masks=_masks_of)
    by_tokens = {tuple(s.tokens.tolist()): s for s in segs}
    main = by_tokens[(1, 2, 3, 4, 5, 6, 7, 8)]
    np.testing.assert_array_equal(main.features[CONSTRAINT_ID], [0, 0, 0, 0, 0, 0, 1, 2])
    got = unpack_mask_bits(main.constraint_masks, V)
    assert got.shape == (2, V)
    assert np.flatnonzero(got[0]).tolist() == [7, 11] and np.flatnonzero(got[1]).tolist() == [8, 11]
    comp = by_tokens[(8, 9, 10)]
    np.testing.assert_array_equal(comp.features[CONSTRAINT_ID], [0, 0, 1])
    if mode == "request":  # the free request's segment has no table
        free = by_tokens[(1, 2, 3, 4, 5)]
        assert free.constraint_masks is None and CONSTRAINT_ID not in free.features


def test_packed_masks_give_the_segments_that_bool_masks_give():
    """constraint_masks may hand over the sampler's packed bits (1/8 of the memory of
    bool [n, V]; what training.rl replays): same ids and tables, and a token outside
    its packed mask is refused alike."""
    from ac2_jax.segments import pack_mask_bits

    as_bool = segments_from_trace(_constrained_trace(), constraint_masks=_masks_of)
    as_bits = segments_from_trace(_constrained_trace(),
                                  constraint_masks=lambda c: pack_mask_bits(_masks_of(c)))
    for a, b in zip(as_bool, as_bits, strict=True):
        np.testing.assert_array_equal(a.features[CONSTRAINT_ID], b.features[CONSTRAINT_ID])
        np.testing.assert_array_equal(a.constraint_masks, b.constraint_masks)

    def off_by_one(c):
        m = _masks_of(c)
        m[0, c.output_ids[0]] = False
        return pack_mask_bits(m)

    with pytest.raises(ValueError, match="not in the allowed set"):
        segments_from_trace(_constrained_trace(), constraint_masks=off_by_one)


def test_untrained_constrained_tokens_get_no_mask():
    t = _constrained_trace()
    t.episodes[0].loss_mask[6:8] = [0, 0]  # e.g. an unchosen branch
    seen = []
    segs = segments_from_trace(t, constraint_masks=lambda c: seen.append(c) or _masks_of(c))
    assert segs[0].constraint_masks is None and len(seen) == 1  # only the compactor's replayed


def test_constrained_tokens_without_masks_or_with_wrong_ones_are_errors():
    t = _constrained_trace()
    with pytest.raises(ValueError, match="sampled under a grammar.*constraint_masks="):
        segments_from_trace(t)
    with pytest.raises(ValueError, match=r"want bool \[2, V\] or packed"):
        segments_from_trace(t, constraint_masks=lambda c: np.ones((1, V), bool))

    def wrong(c):
        m = _masks_of(c)
        m[:, c.output_ids[0]] = False
        return m

    with pytest.raises(ValueError, match="output token 0 .* not in the allowed set"):
        segments_from_trace(t, constraint_masks=wrong)
    with pytest.raises(ValueError, match="output token 0 .*not in the allowed set"):
        segments_from_trace(t, constraint_masks=lambda c: np.ones((len(c.output_ids), 3), bool))
