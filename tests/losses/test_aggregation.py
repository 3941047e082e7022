"""aggregate_loss: token-weighted task loss, invariant to packing; multi-device."""

import functools

import jax
import numpy as np
import pytest

from ac2_jax.losses import aggregate_loss
from ac2_jax.segments import Segment, pack_segments
from tests.support.multidevice import run_mesh_rows, run_pmap_rows


def _segments(seed=0):
    rng = np.random.default_rng(seed)
    segs = []
    for task, n_segs in (("t0", 3), ("t1", 1), ("t2", 2)):
        for _ in range(n_segs):
            n = int(rng.integers(4, 15))
            mask = (rng.random(n) < 0.6).astype(np.float32)
            segs.append(Segment(rng.integers(1, 50, n), mask, task=task))
    return segs


def _per_token_loss(batch):
    # A deterministic per-token "loss" that depends only on the token content
    # (so every packing yields the same value per token).
    return np.sin(batch.tokens * 0.37 + batch.targets * 0.11).astype(np.float32)


def _hand_task_mean(segs):
    by_task = {}
    for s in segs:
        toks, m = s.tokens, s.loss_mask
        l = np.sin(toks[:-1] * 0.37 + toks[1:] * 0.11)
        num, den = by_task.get(s.task, (0.0, 0.0))
        by_task[s.task] = (num + (l * m[1:]).sum(), den + m[1:].sum())
    return np.mean([num / den for num, den in by_task.values() if den > 0])


def test_task_mean_is_invariant_to_packing_and_matches_hand_formula():
    segs = _segments()
    ref = _hand_task_mean(segs)
    values = []
    for seq_len, order in ((16, None), (24, [5, 3, 1, 0, 2, 4]), (64, [2, 0, 4, 1, 5, 3])):
        ordered = segs if order is None else [segs[i] for i in order]
        b = pack_segments(ordered, seq_len=seq_len)
        values.append(float(aggregate_loss(_per_token_loss(b), b, "task_mean")))
    np.testing.assert_allclose(values, ref, rtol=1e-6)


def test_modes_against_hand_formulas():
    segs = _segments(1)
    b = pack_segments(segs, seq_len=32)
    l, m = _per_token_loss(b), b.loss_mask
    assert float(aggregate_loss(l, b, "token_mean")) == pytest.approx((l * m).sum() / m.sum(), rel=1e-6)
    per_seg = []
    for s in segs:
        ll = np.sin(s.tokens[:-1] * 0.37 + s.tokens[1:] * 0.11)
        if s.loss_mask[1:].sum() > 0:
            per_seg.append((ll * s.loss_mask[1:]).sum() / s.loss_mask[1:].sum())
    assert float(aggregate_loss(l, b, "segment_mean")) == pytest.approx(np.mean(per_seg), rel=1e-5)
    assert float(aggregate_loss(l, b, "constant", normalizer=100.0)) == pytest.approx((l * m).sum() / 100, rel=1e-6)
    with pytest.raises(ValueError, match="mode"):
        aggregate_loss(l, b, "sum")


@pytest.mark.parametrize("mode", ["task_mean", "token_mean", "segment_mean", "constant"])
def test_equal_under_jit_pmap_and_mesh(mode):
    segs = _segments(2) * 3
    b = pack_segments(segs, seq_len=16, rows_multiple=8)
    l = _per_token_loss(b)
    agg = functools.partial(aggregate_loss, mode=mode, normalizer=100.0 if mode == "constant" else None)
    eager = float(agg(l, b))
    jitted = float(jax.jit(agg)(l, b))
    pmapped = run_pmap_rows(lambda l, b, axis_name: agg(l, b, axis_name=axis_name), l, b)
    meshed, _ = run_mesh_rows(agg, l, b)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(pmapped), eager, rtol=1e-6)  # every device: the global value
    np.testing.assert_allclose(float(meshed), eager, rtol=1e-6)


def _weighted(segs, w):
    return [Segment(s.tokens, s.loss_mask, task=s.task, weight=w) for s in segs]


def _theta_loss(batch, mode="task_mean"):
    """Loss and gradient of a toy per-token loss l_t = theta * sin(...) (l linear in theta)."""
    base = _per_token_loss(batch)
    return jax.value_and_grad(lambda th: aggregate_loss(th * base, batch, mode))(1.5)


@pytest.mark.parametrize("layout", ["flat", "tree"])
def test_segment_weight_scales_loss_and_gradient(layout):
    """A stale trace down-weighted by w trains with w times the loss and gradient (single trace)."""
    segs = [s for s in _segments(3) if s.task == "t0"]
    one = pack_segments(_weighted(segs, 1.0), seq_len=32, layout=layout)
    low = pack_segments(_weighted(segs, 0.0625), seq_len=32, layout=layout)
    (l1, g1), (lw, gw) = _theta_loss(one), _theta_loss(low)
    assert abs(float(l1)) > 1e-3
    np.testing.assert_allclose(float(lw), 0.0625 * float(l1), rtol=1e-6)
    np.testing.assert_allclose(float(gw), 0.0625 * float(g1), rtol=1e-6)


def test_mixed_fresh_and_stale_batch_matches_hand_formula_flat_and_tree():
    """L = mean over tasks of sum_t w m l / N_task, N_task the unweighted count."""
    segs = _segments(4)
    w = {"t0": 1.0, "t1": 0.25, "t2": 0.5}
    segs = [Segment(s.tokens, s.loss_mask, task=s.task, weight=w[s.task])
            for s in segs]
    by_task = {}
    for s in segs:
        ll = np.sin(s.tokens[:-1] * 0.37 + s.tokens[1:] * 0.11)
        num, den = by_task.get(s.task, (0.0, 0.0))
        by_task[s.task] = (num + w[s.task] * (ll * s.loss_mask[1:]).sum(), den + s.loss_mask[1:].sum())
    want = np.mean([num / den for num, den in by_task.values()])
    for layout in ("flat", "tree"):
        b = pack_segments(segs, seq_len=64, layout=layout)
        np.testing.assert_allclose(float(aggregate_loss(_per_token_loss(b), b)), want, rtol=1e-5)


def test_constant_mode_needs_an_explicit_normalizer():
    """The default used to be the padded R*L, so the loss scale changed with the row count."""
    b = pack_segments(_segments(1), seq_len=32)
    with pytest.raises(ValueError, match="normalizer"):
        aggregate_loss(_per_token_loss(b), b, "constant")
    padded = pack_segments(_segments(1), seq_len=32, min_rows=16)
    np.testing.assert_allclose(float(aggregate_loss(_per_token_loss(padded), padded, "constant", normalizer=50.0)),
                               float(aggregate_loss(_per_token_loss(b), b, "constant", normalizer=50.0)),
                               rtol=1e-6)
