"""Block-sparse attention equals dense attention (values and gradients, fp32,
atol 1e-5) on flat packed rows, tree rows and decode against a cache, and
really skips tiles: its loop's own tile count is checked."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ac2_jax.models import (
    AttentionMask,
    blocksparse_attention,
    blocksparse_attention_with_count,
    dense_attention,
)
from tests.models.test_attention_mask import flat_rows, tree_rows

TOL = 1e-5
B, H, K, HD = 2, 4, 2, 8


def qkv(rng, Lq, Lk=None, dtype=jnp.float32):
    Lk = Lq if Lk is None else Lk
    q = rng.standard_normal((B, Lq, H, HD))
    k, v = rng.standard_normal((B, Lk, K, HD)), rng.standard_normal((B, Lk, K, HD))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def assert_equal_values_and_grads(mask, q, k, v, block):
    """Outputs and d(sum(out * w))/d(q, k, v) of both kernels agree to TOL."""
    w = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32)

    def run(attend):
        def loss(q, k, v):
            out = attend(q, k, v)
            return jnp.sum(out * w), out
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    got, out = run(lambda q, k, v: blocksparse_attention(q, k, v, mask, block_q=block,
                                                         block_k=block))
    want, ref = run(lambda q, k, v: dense_attention(q, k, v, mask.dense()))
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)
    for name, g, r in zip("qkv", got, want):
        np.testing.assert_allclose(g, r, atol=TOL, rtol=0, err_msg=f"d{name}")


def test_flat_packed_rows_equal_dense():
    rng = np.random.default_rng(0)
    mask = AttentionMask.packed(jnp.asarray(flat_rows(rng, B, 100)))  # 100: not a block multiple
    assert_equal_values_and_grads(mask, *qkv(rng, 100), block=16)


def test_tree_rows_equal_dense():
    rng = np.random.default_rng(1)
    seg, sub = tree_rows(rng, B, 96)
    mask = AttentionMask.packed(jnp.asarray(seg), jnp.asarray(sub))
    assert_equal_values_and_grads(mask, *qkv(rng, 96), block=16)


def test_decode_against_a_cache_equals_dense():
    """One query per row against a 64-slot cache: row 0 at position 37, row 1 padding."""
    rng = np.random.default_rng(2)
    S = 64
    mask = AttentionMask.decode(jnp.asarray([[37], [-1]], jnp.int32), S)
    q, k, v = qkv(rng, 1, S)
    assert_equal_values_and_grads(mask, q, k, v, block=16)
    out, count = jax.jit(lambda q, k, v: blocksparse_attention_with_count(
        q, k, v, mask, block_k=16))(q, k, v)
    assert int(count) == 3  # slots 0..37 lie in 3 of the 4 key tiles; the padding row: none
    assert not np.asarray(out[1]).any()


def test_tiles_of_short_segments_are_skipped():
    """One packed row of 16 segments of 32 tokens, 32-token tiles: each query tile
    sees only its own diagonal tile, 16 of 256 (the dense count)."""
    rng = np.random.default_rng(3)
    L, block = 512, 32
    seg = jnp.asarray(np.repeat(np.arange(1, 17), 32)[None], jnp.int32)
    q, k, v = (x[:1] for x in qkv(rng, L))
    mask = AttentionMask.packed(seg)
    out, count = jax.jit(lambda q, k, v: blocksparse_attention_with_count(
        q, k, v, mask, block_q=block, block_k=block))(q, k, v)
    dense_count = (L // block) ** 2
    assert int(count) == 16 and dense_count == 256
    assert int(count) == int(mask.tiles(block, block).sum())
    first = dense_attention(q[:, :32], k[:, :32], v[:, :32], mask.dense()[:, :32, :32])
    np.testing.assert_allclose(out[:, :32], first, atol=TOL, rtol=0)  # segments alone
    # One segment over the row: the causal triangle, 136 of 256.
    one = AttentionMask.packed(jnp.ones((1, L), jnp.int32))
    assert int(one.tiles(block, block).sum()) == 16 * 17 // 2


def test_bad_inputs():
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, 32)
    with pytest.raises(ValueError, match="mask shape"):
        blocksparse_attention(q, k, v, AttentionMask.packed(jnp.ones((B, 16), jnp.int32)))
    with pytest.raises(ValueError, match="not a multiple"):
        blocksparse_attention(q[:, :, :3], k, v, AttentionMask.packed(jnp.ones((B, 32),
                                                                                jnp.int32)))
