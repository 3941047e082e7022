"""constraints: segments' mask tables -> one batch table, ids aligned with targets,
through the flat and tree packers; a batch without a mask packs as before."""

import dataclasses

import jax
import numpy as np
import pytest

from ac2_jax.segments import (
    CONSTRAINT_ID,
    merge_constraint_tables,
    pack_mask_bits,
    pack_segments,
    resolve_constraints,
    unpack_mask_bits,
)
from tests.support.rl_like_segments import rl_like_segment

V = 40


def _mask(*allowed):
    m = np.zeros(V, bool)
    m[list(allowed)] = True
    return m


def _seg(tokens, task, masks=None, adv=1.0):
    """A segment whose last len(masks) tokens are trained and constrained by `masks`
    (bool [k, V]), or trained and free (masks None)."""
    n = len(tokens)
    mask = (np.arange(n) >= n // 2).astype(np.float32)
    s = rl_like_segment(np.asarray(tokens), mask, -0.1 * mask, task=task, advantage=adv)
    if masks is None:
        return s
    ids = np.zeros(n, np.int32)
    ids[n - len(masks):] = np.arange(1, len(masks) + 1)
    return s.with_constraints(ids, pack_mask_bits(np.stack(masks)))


def test_merge_renumbers_batch_wide_and_stores_equal_masks_once():
    a, b, c = _mask(1, 2), _mask(3), _mask(4, 5, 6)
    s0 = _seg([9, 8, 7, 1, 3], "t0", [a, b])
    s1 = _seg([9, 8, 7, 4], "t1")
    s2 = _seg([9, 8, 5, 3, 4], "t2", [b, c])
    out, table = merge_constraint_tables([s0, s1, s2])
    np.testing.assert_array_equal(unpack_mask_bits(table, V), np.stack([a, b, c]))
    np.testing.assert_array_equal(out[0].features[CONSTRAINT_ID], [0, 0, 0, 1, 2])
    np.testing.assert_array_equal(out[1].features[CONSTRAINT_ID], [0, 0, 0, 0])  # added 0s
    np.testing.assert_array_equal(out[2].features[CONSTRAINT_ID], [0, 0, 0, 2, 3])
    assert all(s.constraint_masks is None for s in out)
    # No table anywhere: the segments as they are, no feature added.
    same, none = merge_constraint_tables([s1])
    assert none is None and CONSTRAINT_ID not in same[0].features


@pytest.mark.parametrize("layout", ["flat", "tree"])
def test_packed_ids_follow_targets_and_index_the_batch_table(layout):
    a, b, c = _mask(1, 2, 30), _mask(3, 7), _mask(4, 5, 6, 39)
    segs = [_seg([9, 8, 7, 1, 3], "t0", [a, b]), _seg([11, 12, 13, 4], "t1"),
            _seg([21, 22, 5, 3, 4], "t2", [b, c])]
    batch = pack_segments(segs, seq_len=16, layout=layout, min_masks=4)
    assert batch.constraint_masks.shape == (4, 2)  # pow2 >= 3 masks, ceil(40 / 32) words
    ids = batch.features[CONSTRAINT_ID]
    allowed = unpack_mask_bits(batch.constraint_masks, V)
    seen = {}
    for r, p in zip(*np.nonzero(batch.segment_ids)):
        tok, tgt, k = batch.tokens[r, p], batch.targets[r, p], ids[r, p]
        if k:
            assert allowed[k - 1, tgt], (tok, tgt)
            seen[(int(tok), int(tgt))] = unpack_mask_bits(batch.constraint_masks[k - 1], V)
    # Every constrained target with the mask it was drawn under (by (input, target)).
    np.testing.assert_array_equal(seen[(7, 1)], a)
    np.testing.assert_array_equal(seen[(1, 3)], b)
    np.testing.assert_array_equal(seen[(5, 3)], b)
    np.testing.assert_array_equal(seen[(3, 4)], c)
    assert len(seen) == 4 and int((ids > 0).sum()) == 4


def test_tree_merges_trained_tokens_only_under_the_same_mask():
    a, b = _mask(1, 2), _mask(1, 5)
    # Same tokens and losses; the last token under a, a, b.
    segs = [_seg([9, 8, 7, 1], f"t{i}", [m], adv=1.0) for i, m in enumerate([a, a, b])]
    segs = [dataclasses.replace(s, task="t") for s in segs]
    batch = pack_segments(segs, seq_len=16, layout="tree")
    # One trie: 9 8 7 shared; the prediction 7 -> 1 once under a (count 2), once under b.
    ids = batch.features[CONSTRAINT_ID][0]
    at = np.flatnonzero(batch.targets[0] == 1)
    assert sorted(batch.loss_mask[0, at].tolist()) == [1.0, 2.0]
    assert len(set(ids[at].tolist())) == 2 and all(ids[at] > 0)
    # Without masks the three would be one node of count 3.
    free = pack_segments([_seg([9, 8, 7, 1], "t") for _ in range(3)], seq_len=16,
                         layout="tree")
    assert free.loss_mask[0, free.targets[0] == 1].tolist() == [3.0]


@pytest.mark.parametrize("layout", ["flat", "tree"])
def test_a_batch_without_masks_packs_as_before(layout):
    segs = [_seg([9, 8, 7, 1, 3], "t0"), _seg([1, 2, 3], "t1")]
    batch = pack_segments(segs, seq_len=8, layout=layout)
    assert batch.constraint_masks is None and CONSTRAINT_ID not in batch.features
    assert all(leaf.shape == (batch.shape[0], 8) for leaf in jax.tree.leaves(batch))


def test_one_share_takes_the_global_table():
    a = _mask(1, 2)
    segs, table = merge_constraint_tables([_seg([9, 8, 7, 1], "t0", [a]), _seg([3, 4], "t1")])
    share = pack_segments(segs[1:], seq_len=8, constraint_masks=table, min_masks=2)
    assert share.constraint_masks.shape == (2, 2)  # the global table, padded
    np.testing.assert_array_equal(share.constraint_masks[0], table[0])
    assert not share.features[CONSTRAINT_ID].any()


def test_errors_say_what_is_wrong():
    a = _mask(1)
    own = _seg([9, 8, 1], "t0", [a])
    with pytest.raises(ValueError, match="table was given too"):
        pack_segments([own], seq_len=8, constraint_masks=own.constraint_masks)
    orphan = _seg([9, 8, 1], "t0").with_constraints(np.array([0, 0, 1], np.int32), None)
    with pytest.raises(ValueError, match="no mask table"):
        pack_segments([orphan], seq_len=8)
    with pytest.raises(ValueError, match="holds 1 masks"):
        resolve_constraints([orphan.with_constraints(np.array([0, 0, 2]), None)],
                            own.constraint_masks, 1, "pack")
    with pytest.raises(ValueError, match="uint32"):
        pack_segments([orphan], seq_len=8, constraint_masks=np.ones((1, 2), np.int64))
    with pytest.raises(ValueError, match="row 1..1"):
        own.with_constraints(np.array([0, 0, 2], np.int32), own.constraint_masks)
    with pytest.raises(ValueError, match="same vocabulary"):
        pack_segments([own, _seg([9, 1], "t1", [np.ones(V + 64, bool)])], seq_len=8)

