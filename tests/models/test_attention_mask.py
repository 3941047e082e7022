"""AttentionMask: its dense form is exactly losses.attention_mask (flat and tree
rows) and the KV-cache mask; its tile map never drops a tile with a visible pair
and is exact for flat rows of contiguous segments."""

import jax.numpy as jnp
import numpy as np
import pytest

from ac2_jax.losses import attention_mask
from ac2_jax.models import AttentionMask


def flat_rows(rng, B, L):
    """Rows of contiguous segments 1..n of random lengths, then padding (0)."""
    seg = np.zeros((B, L), np.int32)
    for b in range(B):
        at, s = 0, 1
        while at < L - 4:
            n = int(rng.integers(1, 40))
            seg[b, at:at + n] = s
            at, s = at + n, s + 1
    return seg


def tree_rows(rng, B, L):
    """Rows of random DFS trees (subtree ends) with padding at the end."""
    sub = np.tile(np.arange(L, dtype=np.int32), (B, 1))
    seg = np.zeros((B, L), np.int32)
    for b in range(B):
        n = int(rng.integers(L // 2, L))
        stack = []
        for i in range(n):
            while stack and rng.random() < 0.3:  # close some open subtrees
                sub[b, stack.pop()] = i - 1
            stack.append(i)
        for j in stack:
            sub[b, j] = n - 1
        seg[b, :n] = 1 + (np.arange(n) // 7) % 3  # several segment ids within a tree
    return seg, sub


def block_any(dense, bq, bk):
    B, Lq, Lk = dense.shape
    return dense.reshape(B, Lq // bq, bq, Lk // bk, bk).any(axis=(2, 4))


def test_packed_dense_equals_losses_attention_mask():
    rng = np.random.default_rng(0)
    seg = flat_rows(rng, 3, 96)
    got = AttentionMask.packed(jnp.asarray(seg)).dense()
    np.testing.assert_array_equal(got, attention_mask(jnp.asarray(seg)))
    seg, sub = tree_rows(rng, 3, 96)
    got = AttentionMask.packed(jnp.asarray(seg), jnp.asarray(sub)).dense()
    np.testing.assert_array_equal(got, attention_mask(jnp.asarray(seg), jnp.asarray(sub)))
    assert got.sum() < np.tril(np.ones((96, 96))).sum() * 3  # tree rows do mask something


def test_decode_mask_is_slots_up_to_the_position():
    pos = jnp.asarray([[0, 1, 2, -1], [5, 6, -1, -1]])
    got = np.asarray(AttentionMask.decode(pos, 8).dense())
    want = (np.arange(8)[None, None, :] <= np.asarray(pos)[:, :, None]) & (
        np.asarray(pos)[:, :, None] >= 0)
    np.testing.assert_array_equal(got, want)
    assert not got[0, 3].any()  # padding sees nothing


@pytest.mark.parametrize("kind", ["flat", "tree"])
def test_tiles_never_drop_a_visible_pair(kind):
    rng = np.random.default_rng(1)
    for bq, bk in ((8, 8), (16, 8), (32, 32)):
        if kind == "flat":
            mask = AttentionMask.packed(jnp.asarray(flat_rows(rng, 4, 128)))
        else:
            seg, sub = tree_rows(rng, 4, 128)
            mask = AttentionMask.packed(jnp.asarray(seg), jnp.asarray(sub))
        need = block_any(np.asarray(mask.dense()), bq, bk)
        tiles = np.asarray(mask.tiles(bq, bk))
        assert (tiles | ~need).all()  # every tile with a visible pair is kept
        if kind == "flat":  # contiguous segments: exactly those tiles
            np.testing.assert_array_equal(tiles, need)
        else:  # fewer than the causal triangle's tiles: the tree structure is used
            causal = np.tril(np.ones((128, 128), bool))[None].repeat(4, 0)
            assert tiles.sum() < block_any(causal, bq, bk).sum()


def test_padded_mask_adds_nothing_visible_and_decode_tiles_stop_at_the_position():
    rng = np.random.default_rng(2)
    mask = AttentionMask.packed(jnp.asarray(flat_rows(rng, 2, 50)))
    padded = mask.pad(64, 64)
    dense = np.asarray(padded.dense())
    np.testing.assert_array_equal(dense[:, :50, :50], mask.dense())
    assert not dense[:, 50:].any() and not dense[:, :, 50:].any()
    dec = AttentionMask.decode(jnp.asarray([[9], [40]]), 64)
    np.testing.assert_array_equal(np.asarray(dec.tiles(1, 16))[:, 0],
                                  [[True, False, False, False], [True, True, True, False]])
    with pytest.raises(ValueError, match="multiples of the blocks"):
        mask.tiles(16, 16)
    with pytest.raises(ValueError, match="cannot shrink"):
        mask.pad(40, 64)
