"""The TPU kernel "pallas_tpu" (`models.kernels.attention_tpu`) in Pallas interpret mode on CPU
against the dense reference, fp32, atol 1e-5: values and the gradients in q, k, v of
flat packed rows (segment ids, padding, grouped-query heads) and tree rows (shared
prefix, branches, a nested branch, two trees in a row, padding; `subtree_end`), and
the values of a decode chunk against the KV cache, under a data x tensor mesh (the
kernel runs in shard_map). Blocks of 8 keep interpret mode fast; the TPU block
rules (8 x 128) are checked by compiling the kernel for a v5e topology with libtpu:
tests/test_aot.py's RL step holds the attention kernel (forward, dq, dk/dv, blocks of
64 rounded up) and the experts' gmm / tgmm."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ac2_jax.models import AttentionMask, dense_attention
from ac2_jax.models.kernels.attention_tpu import flat_rule, fold_rows, pallas_tpu_attention
from ac2_jax.models.moe import experts_apply
from ac2_jax.training import make_mesh

TOL = 1e-5


def tree_rows():
    """Two tree rows of 23 tokens (DFS layout; subtree_end[j] = the last token of j's
    subtree, so query i sees key j iff j <= i <= subtree_end[j]). Row 0: prefix 0..5;
    branch A 6..12 holding a nested branch 9..10 and its sibling 11..12; branch B
    13..19; padding 20..22. Row 1: two trees (0..9: prefix 0..3, branches 4..6, 7..9;
    10..20: prefix 10..12, branches 13..16, 17..20), padding 21..22."""
    end = np.tile(np.arange(23), (2, 1))
    end[0, 0:6], end[0, 6:9], end[0, 9:11], end[0, 11:13], end[0, 13:20] = 19, 12, 10, 12, 19
    end[1, 0:4], end[1, 4:7], end[1, 7:10] = 9, 6, 9
    end[1, 10:13], end[1, 13:17], end[1, 17:21] = 20, 16, 20
    seg = np.stack([np.r_[np.ones(20), np.zeros(3)], np.r_[np.ones(21), np.zeros(2)]])
    mask = AttentionMask.packed(jnp.asarray(seg, jnp.int32), jnp.asarray(end, jnp.int32))
    dense = np.asarray(mask.dense())
    assert dense[0, 12, 8] and not dense[0, 12, 10] and not dense[0, 15, 7] and dense[0, 15, 3]
    assert not dense[1, 10:, :10].any() and dense[1, 20, 12] and not dense[1, 20, 15]
    return mask


def test_flat_tree_and_decode_rows_under_a_mesh_equal_dense():
    """One kernel call (one compilation) over six rows: two flat packed rows, two tree
    rows (`flat_rule`: the tree rule as the flat rule on 0 / 1 segments, checked exact
    here) and two decode chunks; rows over data and kv heads over tensor of a 2 x 2
    mesh (the kernel in shard_map). 23 tokens: rows and keys padded to the blocks."""
    L, H, K, hd = 23, 4, 2, 16
    # flat: three segments + padding; one segment over all blocks + padding
    seg = np.stack([np.repeat([1, 2, 3, 0], [9, 6, 5, 3]), np.repeat([4, 0], [19, 4])])
    flat, tree = AttentionMask.packed(jnp.asarray(seg, jnp.int32)), tree_rows()
    # decode: a chunk of 23 new tokens against a 23-slot cache; row 1 has 12 tokens
    # then padding (position -1: zeros)
    pos = np.stack([np.arange(23), np.r_[np.arange(3, 15), -np.ones(11, int)]])
    decode = AttentionMask.decode(jnp.asarray(pos, jnp.int32), L)
    as_tree = flat_rule(tree)
    np.testing.assert_array_equal(as_tree.dense(), tree.dense())
    rows = [m.replace(causal=False) for m in (flat, as_tree, decode)]
    mask = jax.tree.map(lambda *x: jnp.concatenate(x), *rows)
    B = mask.shape[0]
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, L, H, hd)), jnp.float32)
    # k, v kv heads major (the sampler's cache layout; the kernel's own)
    k, v = (jnp.asarray(rng.standard_normal((B, K, L, hd)), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def grads(attend):
        def loss(q, k, v):
            out = attend(q, k, v)
            return jnp.sum(out * w), out

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    with jax.set_mesh(make_mesh(data=2, tensor=2)):
        got, out = grads(
            lambda q, k, v: pallas_tpu_attention(
                q, k, v, mask, block_q=8, block_k=8, kv_heads_major=True, interpret=True
            )
        )
    want, ref = grads(lambda q, k, v: dense_attention(q, k, v, mask.dense(), kv_heads_major=True))
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)
    for name, g, r in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(g, r, atol=TOL, rtol=0, err_msg=f"d{name}")
    assert jnp.all(out[5, 12:] == 0) and jnp.abs(out[1, -4:]).min() > 0  # decode / flat padding


def random_rows(rng, n, L):
    """n random flat rows (sorted or interleaved segment ids, then padding) and n random
    tree rows (DFS forests: each token a child of a token on the last one's path, or
    a new root; then padding), as segment ids [2n, L] and subtree_end [n, L]."""
    seg, tseg, end = np.zeros((n, L), int), np.zeros((n, L), int), np.tile(np.arange(L), (n, 1))
    for r in range(n):
        used = rng.integers(0, L + 1)
        ids = rng.integers(1, 4, used)
        seg[r, :used] = np.sort(ids) if r % 2 else ids
        path: list[int] = []
        for i in range(rng.integers(L // 2, L + 1)):
            path = path[: rng.integers(1, len(path) + 1)] if path and rng.random() < 0.8 else []
            end[r, path] = i
            path.append(i)
            tseg[r, i] = 1
    return seg, tseg, end


def test_the_tile_table_skips_no_tile_with_a_visible_pair():
    """The kernel's tile table (`fold_rows(...).tiles`: a skipped tile is silent wrong
    attention) against the dense mask's tiles, on 20 random flat rows, 20 random tree
    rows and 20 random decode chunks against a 37-slot cache, for grouped-query folds
    and block sizes that do not divide the lengths: every tile holding a visible pair
    is computed."""
    rng, L = np.random.default_rng(7), 23
    seg, tseg, end = random_rows(rng, 20, L)
    tree = AttentionMask.packed(jnp.asarray(tseg, jnp.int32), jnp.asarray(end, jnp.int32))
    np.testing.assert_array_equal(flat_rule(tree).dense(), tree.dense())
    rows = [AttentionMask.packed(jnp.asarray(seg, jnp.int32)), flat_rule(tree)]
    packed = jax.tree.map(lambda *x: jnp.concatenate(x), *[m.replace(causal=False) for m in rows])
    pos = np.sort(rng.integers(-1, 37, (20, 5)), axis=1)  # -1: padding
    decode = AttentionMask.decode(jnp.asarray(pos, jnp.int32), 37)

    @functools.partial(jax.jit, static_argnums=(1, 2, 3))
    def wrong_and_skipped(mask, G, bq, bk):
        B, Lq, Lk = mask.shape
        rows_p, Lk_p = -(-G * Lq // bq) * bq, -(-Lk // bk) * bk
        folded = fold_rows(mask.pad(Lq, Lk_p), G, rows_p)
        seen = folded.dense().reshape(B, rows_p // bq, bq, Lk_p // bk, bk).any(axis=(2, 4))
        table = folded.tiles(bq, bk)
        return jnp.sum(seen & ~table), jnp.sum(~table)

    for mask in (packed, decode):
        for G, bq, bk in ((1, 8, 8), (2, 5, 3), (3, 16, 16)):
            wrong, skipped = wrong_and_skipped(mask, G, bq, bk)
            assert int(wrong) == 0, (mask.shape, G, bq, bk)
            assert int(skipped) > 0  # the table does skip tiles


def test_refuses_a_sliding_window():
    mask = AttentionMask.packed(
        jnp.ones((1, 8), jnp.int32), positions=jnp.arange(8)[None], window=4
    )
    q = jnp.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match="sliding window"):
        pallas_tpu_attention(q, q, q, mask, interpret=True)


def test_refuses_a_mask_or_heads_that_do_not_fit():
    """The shape checks it shares with blocksparse (`attention_mask.check_shapes`), each
    error naming the kernel; refused before any kernel is traced."""
    mask = AttentionMask.packed(jnp.ones((1, 8), jnp.int32))
    q, kv = jnp.zeros((1, 8, 3, 8)), jnp.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match="pallas_tpu attention: 3 query heads are not a "
                                         "multiple of 2 kv heads"):
        pallas_tpu_attention(q, kv, kv, mask, interpret=True)
    with pytest.raises(ValueError, match=r"pallas_tpu attention: mask shape \(1, 8, 8\) "
                                         r"does not match q \(1, 4, 2, 8\)"):
        pallas_tpu_attention(q[:, :4, :2], kv[:, :4], kv[:, :4], mask, interpret=True)


def test_moe_experts_through_gmm_equal_ragged_dot():
    """The dropless experts through the TPU grouped GEMM (megablox gmm, interpret
    mode) against `jax.lax.ragged_dot`: outputs and gradients in x and the three
    expert weights, fp32, atol 1e-6, under a data x tensor mesh (tokens over data,
    the experts' hidden width over tensor: partial down projections summed)."""
    N, D, F, E, k = 14, 16, 8, 4, 2
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)
    wg, wu = (jnp.asarray(rng.standard_normal((E, D, F)) / 4, jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.standard_normal((E, F, D)) / 4, jnp.float32)
    ids = jnp.asarray(rng.integers(0, E - 1, (N, k)), jnp.int32)  # expert 3 gets no token
    weights = jnp.asarray(rng.uniform(size=(N, k)), jnp.float32)
    real = jnp.asarray(np.arange(N) % 7 != 6)  # two padding tokens
    cot = jnp.asarray(rng.standard_normal((N, D)), jnp.float32)

    def grads(grouped):
        def loss(x, wg, wu, wd):
            y, sizes, dropped = experts_apply(
                x, ids, weights, real, wg, wu, wd, grouped=grouped, interpret=True
            )
            return jnp.sum(y * cot), (y, sizes, dropped)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(x, wg, wu, wd)

    with jax.set_mesh(make_mesh(data=2, tensor=2)):
        got, (y, sizes, dropped) = grads("gmm")
    want, (ref, ref_sizes, _) = grads("ragged_dot")
    np.testing.assert_allclose(y, ref, atol=1e-6, rtol=0)
    np.testing.assert_array_equal(sizes, ref_sizes)
    assert int(dropped) == 0 and int(sizes[3]) == 0 and jnp.all(y[~real] == 0)
    for name, g, r in zip(("x", "wg", "wu", "wd"), got, want, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-6, rtol=0, err_msg=f"d{name}")


def test_a_tpu_train_step_is_traced_under_its_mesh():
    """On TPU the train step traces under its mesh (`train_step._under_mesh`), so the
    kernels above run in shard_map rather than XLA gathering their operands."""
    from ac2_jax.training.core.train_step import _under_mesh

    mesh, seen = make_mesh(data=2, tensor=2), []
    _under_mesh(lambda: seen.append(jax.sharding.get_abstract_mesh()), mesh)()
    assert seen == [mesh.abstract_mesh] and jax.sharding.get_abstract_mesh().empty
