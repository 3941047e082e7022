"""pack_segments: first-fit decreasing, alignment, truncation, errors."""

import numpy as np
import pytest

from ac2_jax.segments import Segment, pack_segments, pad_batch_rows, task_names
from ac2_jax.segments.batch import pow2_bucket
from tests.support.rl_like_segments import rl_like_segment


def _seg(n, task, start=1, adv=1.0):
    toks = np.arange(start, start + n)
    mask = (np.arange(n) >= n // 2).astype(np.float32)
    return rl_like_segment(toks, mask, -0.1 * mask, task=task, advantage=adv)


def test_first_fit_decreasing_and_alignment():
    segs = [_seg(5, "a"), _seg(3, "b", 100), _seg(4, "a", 200), _seg(6, "c", 300)]
    b = pack_segments(segs, seq_len=8)
    # FFD: 6 -> row0, 5 -> row1, 4 -> row2, 3 -> row1 (5+3=8).
    assert b.shape == (3, 8)
    assert task_names(segs) == ("a", "b", "c")
    assert b.num_tasks == 4 and b.num_segments == 4  # power-of-two capacities
    row1 = b.tokens[1]
    np.testing.assert_array_equal(row1, [1, 2, 3, 4, 5, 100, 101, 102])
    np.testing.assert_array_equal(b.segment_ids[1], [1, 1, 1, 1, 1, 2, 2, 2])
    np.testing.assert_array_equal(b.positions[1], [0, 1, 2, 3, 4, 0, 1, 2])
    # targets are the next token of the same segment; 0 at a segment's end.
    np.testing.assert_array_equal(b.targets[1], [2, 3, 4, 5, 0, 101, 102, 0])
    # loss_mask[p] is the mask of targets[p]: a (n=5) masks tokens 2..4, b (n=3) 1..2.
    np.testing.assert_array_equal(b.loss_mask[1], [0, 1, 1, 1, 0, 1, 1, 0])
    np.testing.assert_allclose(b.features["sampler_logprobs"][1], [0, -.1, -.1, -.1, 0, -.1, -.1, 0], atol=1e-7)
    np.testing.assert_array_equal(b.task_ids[1], [0, 0, 0, 0, 0, 1, 1, 1])
    # Padding row content: row 2 holds 4 tokens then padding.
    np.testing.assert_array_equal(b.segment_ids[2], [1, 1, 1, 1, 0, 0, 0, 0])
    assert b.num_real_tokens == 18


def test_row_padding_for_devices():
    b = pack_segments([_seg(3, "a")], seq_len=4, rows_multiple=8)
    assert b.shape == (8, 4)
    assert b.loss_mask[1:].sum() == 0


def test_too_long_is_error_or_truncated():
    s = _seg(10, "a")
    with pytest.raises(ValueError, match="10 tokens.*seq_len=6"):
        pack_segments([s], seq_len=6)
    b = pack_segments([s], seq_len=6, truncate=True)
    np.testing.assert_array_equal(b.tokens[0], [1, 2, 3, 4, 5, 6])
    # Token 7 was cut: the last kept position predicts nothing.
    np.testing.assert_array_equal(b.loss_mask[0], [0, 0, 0, 0, 1, 0])


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="no segments"):
        pack_segments([], seq_len=4)
    with pytest.raises(ValueError, match="empty"):
        pack_segments([Segment([], [], task="x")], seq_len=4)
    with pytest.raises(ValueError, match="layout"):
        pack_segments([_seg(3, "a")], seq_len=4, layout="zigzag")


def test_pow2_bucket_is_the_one_bucketing_helper():
    # lo=1: the next power of two (static task / segment capacities); 0 -> 1.
    assert [pow2_bucket(n) for n in (0, 1, 2, 3, 5, 16, 17)] == [1, 1, 2, 4, 8, 16, 32]
    # lo * 2**k >= n, capped at hi (sampler rows, cache and prefill lengths).
    assert [pow2_bucket(n, 1, 16) for n in (1, 2, 3, 5, 16, 40)] == [1, 2, 4, 8, 16, 16]
    assert pow2_bucket(3, 8, 64) == 8 and pow2_bucket(100, 16, 96) == 96
    assert pow2_bucket(33, 32) == 64 and pow2_bucket(40, 6) == 48
    # the sampler and the packers import this very function
    from ac2_jax.sampling.engine import batching
    from ac2_jax.training.distill import data
    from ac2_jax.training.rl import batching as rl_batching
    from ac2_jax.training.rl import data as rl_data
    assert batching.pow2_bucket is data.pow2_bucket is rl_data.pow2_bucket is pow2_bucket
    assert rl_batching.pow2_bucket is pow2_bucket


def test_features_are_carried_by_name_aligned_with_targets():
    # A feature the packers know nothing about: an int per token.
    segs = [Segment([1, 2, 3, 4], [0, 1, 1, 1], task="a", features={"tag": [10, 11, 12, 13]}),
            Segment([5, 6, 7], [0, 0, 1], task="b", features={"tag": [20, 21, 22]})]
    for layout in ("flat", "tree"):
        b = pack_segments(segs, seq_len=8, layout=layout, min_rows=2)
        assert set(b.features) == {"tag"} and b.features["tag"].dtype == np.int32
        trained = b.loss_mask > 0
        # column p holds the value of targets[p]'s token: 11, 12, 13 then 22
        assert sorted(b.features["tag"][trained].tolist()) == [11, 12, 13, 22]
        assert sorted(b.targets[trained].tolist()) == [2, 3, 4, 7]
        padded = pad_batch_rows(b, 4)
        assert padded.features["tag"].shape == (4, 8) and padded.features["tag"][2:].sum() == 0


def test_segments_of_one_batch_must_carry_the_same_features():
    a = Segment([1, 2], [0, 1], task="a", features={"x": [0.0, 1.0]})
    b = Segment([3, 4], [0, 1], task="b")
    for layout in ("flat", "tree"):
        with pytest.raises(ValueError, match=r"segment 1 \('b'\) has features \[\]"):
            pack_segments([a, b], seq_len=4, layout=layout)
    with pytest.raises(KeyError, match="no feature 'advantages'.*it has \\['x'\\]"):
        pack_segments([a], seq_len=4).feature("advantages")


def test_tree_merges_trained_tokens_only_where_their_features_agree():
    same = [Segment([1, 2, 3], [0, 1, 1], task="t", features={"v": [0.0, 0.5, 0.5]})
            for _ in range(2)]
    other = [same[0], Segment([1, 2, 3], [0, 1, 1], task="t", features={"v": [0.0, 0.5, 0.9]})]
    merged = pack_segments(same, seq_len=8, layout="tree")
    split = pack_segments(other, seq_len=8, layout="tree")
    assert merged.num_real_tokens == 3 and merged.loss_mask.sum() == 4
    # token 3's feature differs: its prediction (from token 2) is kept apart
    assert split.num_real_tokens == 5
