"""relevance: candidate / relevance masks against brute force, selection helpers,
the token-weighted RMSD loss against the hand formula, and equal values under
jit / pmap / a sharded 8-device mesh (fp32, rtol 1e-6; masks exactly equal).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ac2_jax.losses import (
    candidate_mask,
    masked_token_mean,
    ranked_positions,
    relevance_loss,
    relevance_mask,
    selection_mask,
)
from ac2_jax.segments import Segment, pack_segments
from tests.support.multidevice import run_mesh_rows, run_pmap_rows

R, L = 8, 12


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    div = rng.random((R, L)).astype(np.float32)
    mask = (rng.random((R, L)) < 0.7).astype(np.float32) * rng.choice([1.0, 0.5], (R, L)).astype(np.float32)
    judge = (rng.random((R, L)) < 0.5).astype(np.float32)
    seg = np.sort(rng.integers(0, 3, (R, L)), axis=-1).astype(np.int32)
    return div, mask, judge, seg


def _brute_candidates(div, mask, top_t=None, threshold=None, seg=None):
    keep = np.zeros(div.shape, bool)
    for r in range(div.shape[0]):
        groups = np.zeros(div.shape[1], int) if seg is None else seg[r]
        for g in np.unique(groups):
            pos = [p for p in range(div.shape[1]) if groups[p] == g and mask[r, p] > 0]
            pos.sort(key=lambda p: (-div[r, p], p))
            if top_t is not None:
                pos = pos[:top_t]
            if threshold is not None:
                pos = [p for p in pos if div[r, p] >= threshold]
            keep[r, pos] = True
    return keep


@pytest.mark.parametrize("top_t,threshold", [(3, None), (None, 0.5), (4, 0.3), (None, None), (50, None)])
def test_candidate_mask_matches_brute_force(top_t, threshold):
    div, mask, _, seg = _inputs(1)
    out = np.asarray(candidate_mask(div, mask, top_t=top_t, threshold=threshold))
    keep = _brute_candidates(div, mask, top_t, threshold)
    np.testing.assert_array_equal(out, np.where(keep, mask, 0.0))  # carries mask weights
    out_seg = np.asarray(candidate_mask(div, mask, top_t, threshold, segment_ids=seg))
    np.testing.assert_array_equal(out_seg, np.where(_brute_candidates(div, mask, top_t, threshold, seg),
                                                    mask, 0.0))
    if top_t is not None:
        assert (out > 0).sum(-1).max() <= top_t


def test_candidate_mask_ties_and_masked_positions():
    div = np.array([[0.5, 0.9, 0.5, 0.5, 5.0, 0.1]], np.float32)
    mask = np.array([[1, 1, 1, 1, 0, 1]], np.float32)  # the largest divergence is masked out
    np.testing.assert_array_equal(candidate_mask(div, mask, top_t=3), [[1, 1, 1, 0, 0, 0]])
    np.testing.assert_array_equal(candidate_mask(div, mask, top_t=2, threshold=0.6), [[0, 1, 0, 0, 0, 0]])
    with pytest.raises(ValueError, match="top_t"):
        candidate_mask(div, mask, top_t=0)
    with pytest.raises(ValueError, match="same"):
        candidate_mask(div, mask[:, :-1], top_t=1)


def test_relevance_mask_is_candidates_intersect_judge():
    div, mask, judge, seg = _inputs(2)
    out = np.asarray(relevance_mask(div, mask, judge, top_t=5, threshold=0.2, segment_ids=seg))
    cand = np.asarray(candidate_mask(div, mask, 5, 0.2, segment_ids=seg)) > 0
    kept = {tuple(x) for x in np.argwhere(out > 0)}
    assert kept == {tuple(x) for x in np.argwhere(cand & (judge > 0))}
    assert kept  # non-trivial on these inputs
    np.testing.assert_array_equal(out[out > 0], mask[out > 0])
    with pytest.raises(ValueError, match="judge_mask"):
        relevance_mask(div, mask, judge[:, :3], top_t=2)


def test_selection_mask_and_ranked_positions():
    out = selection_mask([[0, 3], [], [1]], 6, offsets=[0, 2, 4])
    expect = np.zeros((3, 6), np.float32)
    expect[0, [0, 3]] = 1
    expect[2, 5] = 1
    np.testing.assert_array_equal(out, expect)
    with pytest.raises(ValueError, match="row 2 position 2"):
        selection_mask([[0], [], [2]], 6, offsets=[0, 2, 4])
    with pytest.raises(ValueError, match="offsets"):
        selection_mask([[0]], 6, offsets=[0, 1])
    assert ranked_positions([1, 0, 1, 1, 1], [0.2, 9.0, 0.7, 0.2, 0.1]) == [2, 0, 3, 4]


def test_masked_token_mean_and_relevance_loss_hand_formula():
    rng = np.random.default_rng(3)
    segs = []
    for task, n in (("a", 9), ("a", 6), ("b", 7), ("c", 5)):
        segs.append(Segment(rng.integers(1, 30, n), (rng.random(n) < 0.8).astype(np.float32),
                            task=task))
    batch = pack_segments(segs, seq_len=16, rows_multiple=8)
    per_token = rng.normal(size=batch.shape).astype(np.float32)
    div = rng.random(batch.shape).astype(np.float32)
    judge = (rng.random(batch.shape) < 0.6).astype(np.float32)
    kept = np.asarray(relevance_mask(div, batch.loss_mask, judge, top_t=3,
                                     segment_ids=batch.segment_ids))
    # Hand formula: per task sum(m l) / sum(m) over kept positions, mean over tasks with any.
    per_task = []
    for k in range(batch.num_tasks):
        sel = (batch.task_ids == k) & (kept > 0)
        if sel.any():
            per_task.append((per_token[sel] * kept[sel]).sum() / kept[sel].sum())
    np.testing.assert_allclose(relevance_loss(per_token, batch, kept), np.mean(per_task), rtol=1e-6)
    hand_tok = (per_token * kept).sum() / kept.sum()
    np.testing.assert_allclose(masked_token_mean(per_token, kept), hand_tok, rtol=1e-6)
    np.testing.assert_allclose(relevance_loss(per_token, batch, kept, mode="token_mean"), hand_tok, rtol=1e-6)
    assert float(masked_token_mean(per_token, np.zeros_like(kept))) == 0.0

    # Multi-device: pmap with psum over devices, and jit on a row-sharded mesh.
    def fn(pt, d, m, j, s, axis_name=None):
        k = relevance_mask(d, m, j, top_t=3, segment_ids=s)
        return masked_token_mean(pt, k, axis_name=axis_name), k

    args = (per_token, div, np.asarray(batch.loss_mask), judge, np.asarray(batch.segment_ids))
    loss_p, kept_p = run_pmap_rows(fn, *args)
    np.testing.assert_allclose(np.asarray(loss_p), hand_tok, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(kept_p).reshape(kept.shape), kept)
    (loss_m, kept_m), _ = run_mesh_rows(fn, *args)
    np.testing.assert_allclose(loss_m, hand_tok, rtol=1e-6)
    np.testing.assert_array_equal(kept_m, kept)

    # relevance_loss (task_mean over kept positions) under jit, pmap (psum) and the mesh.
    task_mean = float(np.mean(per_task))
    rl = lambda pt, b, k, axis_name=None: relevance_loss(pt, b, k, axis_name=axis_name)  # noqa: E731
    np.testing.assert_allclose(jax.jit(rl)(per_token, batch, kept), task_mean, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(run_pmap_rows(rl, per_token, batch, kept)), task_mean, rtol=1e-6)
    np.testing.assert_allclose(run_mesh_rows(rl, per_token, batch, kept)[0], task_mean, rtol=1e-6)


def test_masks_equal_under_jit_pmap_and_mesh():
    div, mask, judge, seg = _inputs(4)

    def fn(d, m, j, s, axis_name=None):
        return (candidate_mask(d, m, top_t=3), candidate_mask(d, m, 2, 0.3, segment_ids=s),
                relevance_mask(d, m, j, top_t=4, threshold=0.1, segment_ids=s))

    eager = [np.asarray(x) for x in fn(div, mask, judge, seg)]
    for got, want in zip(jax.jit(fn)(div, mask, judge, seg), eager):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(run_pmap_rows(fn, div, mask, judge, seg), eager):
        np.testing.assert_array_equal(np.asarray(got).reshape(want.shape), want)
    out, sharded = run_mesh_rows(fn, div, mask, judge, seg)
    assert len(sharded[0].sharding.device_set) == 8
    for got, want in zip(out, eager):
        np.testing.assert_array_equal(got, want)
    assert jnp.asarray(eager[2]).sum() > 0
