"""Attention masks: segment-causal and tree (ancestor) masks; multi-device."""

import jax
import numpy as np

from ac2_jax.losses import attention_mask, segment_attention_mask, tree_attention_mask
from tests.support.multidevice import run_mesh_rows, run_pmap_rows


def _brute_segment_mask(seg):
    L = len(seg)
    m = np.zeros((L, L), bool)
    for q in range(L):
        for k in range(L):
            m[q, k] = (k <= q and seg[q] == seg[k] and seg[q] > 0) or q == k
    return m


def test_segment_mask_matches_brute_force():
    seg = np.array([[1, 1, 1, 2, 2, 0, 0], [1, 2, 2, 2, 3, 3, 3]])
    got = np.asarray(segment_attention_mask(seg))
    for r in range(2):
        np.testing.assert_array_equal(got[r], _brute_segment_mask(seg[r]))


def test_tree_mask_sees_exactly_ancestors():
    # Trie (DFS order): 0 -> 1 -> {2 -> 3, 4 -> 5}; then padding.
    parent = [-1, 0, 1, 2, 1, 4]
    subtree_end = np.array([[5, 5, 3, 3, 5, 5, 6]])
    seg = np.array([[1, 1, 1, 1, 1, 1, 0]])
    got = np.asarray(tree_attention_mask(subtree_end, seg))[0]
    for q in range(6):
        anc, a = {q}, q
        while parent[a] >= 0:
            a = parent[a]
            anc.add(a)
        np.testing.assert_array_equal(np.nonzero(got[q, :6])[0], sorted(anc))
    assert got[6].tolist() == [False] * 6 + [True]
    # A flat row is the special case subtree_end = end of the segment.
    flat_seg = np.array([[1, 1, 1, 2, 2, 0]])
    flat_end = np.array([[2, 2, 2, 4, 4, 5]])
    np.testing.assert_array_equal(tree_attention_mask(flat_end, flat_seg), segment_attention_mask(flat_seg))


def test_multidevice():
    seg = np.tile(np.array([[1, 1, 2, 2, 2, 0]]), (8, 1))
    ref = np.asarray(attention_mask(seg))
    np.testing.assert_array_equal(jax.jit(attention_mask)(seg), ref)
    pm = run_pmap_rows(lambda s, axis_name: attention_mask(s), seg)
    np.testing.assert_array_equal(np.asarray(pm).reshape(ref.shape), ref)
    meshed, _ = run_mesh_rows(attention_mask, seg)
    np.testing.assert_array_equal(np.asarray(meshed), ref)
