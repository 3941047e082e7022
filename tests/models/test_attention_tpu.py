"""The TPU kernel "pallas_tpu" (`models.attention_tpu`) in Pallas interpret mode on CPU
against the dense reference, fp32, atol 1e-5 (values and the gradients in q, k, v):
flat packed rows (segment ids, padding, grouped-query heads) under a data x tensor
mesh (the kernel runs in shard_map), a tree row (shared prefix, branches, a nested
branch, padding; `subtree_end`), and decode against a cache whose length is no
multiple of the block. Blocks of 8 keep interpret mode fast; the TPU block rules
(8 x 128) are checked by compiling the kernel for a v5e topology with libtpu."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ac2_jax.models import AttentionMask, dense_attention
from ac2_jax.models.attention_tpu import pallas_tpu_attention
from ac2_jax.training import make_mesh

TOL = 1e-5


def qkv(B, Lq, Lk, H=4, K=2, hd=16, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, Lq, H, hd)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, Lk, K, hd)), jnp.float32) for _ in range(2))
    return q, k, v


def check_grads(mask, q, k, v):
    """Values and d/dq, d/dk, d/dv of sum(out * w) against the dense kernel."""
    w = jnp.asarray(np.random.default_rng(7).standard_normal(q.shape), jnp.float32)

    def grads(attend):
        loss = lambda q, k, v: (jnp.sum(attend(q, k, v) * w), attend(q, k, v))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    got, out = grads(
        lambda q, k, v: pallas_tpu_attention(q, k, v, mask, block_q=8, block_k=8, interpret=True)
    )
    want, ref = grads(lambda q, k, v: dense_attention(q, k, v, mask.dense()))
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)
    for name, g, r in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(g, r, atol=TOL, rtol=0, err_msg=f"d{name}")
    return out


def test_flat_packed_rows_under_a_mesh_equal_dense():
    # two rows: three segments + padding, and one segment spanning blocks + padding
    seg = np.stack([np.repeat([1, 2, 3, 0], [9, 6, 5, 4]), np.repeat([4, 0], [19, 5])])
    mask = AttentionMask.packed(jnp.asarray(seg, jnp.int32))
    q, k, v = qkv(2, 24, 24)
    with jax.set_mesh(make_mesh(data=2, tensor=2)):  # rows over data, kv heads over tensor
        out = check_grads(mask, q, k, v)
    assert jnp.abs(out[:, -4:]).min() > 0  # padding tokens see themselves


def test_tree_row_with_subtree_end_equals_dense():
    # DFS layout: prefix 0..5; branch A 6..12 holding a nested branch 9..10 and its
    # sibling 11..12; branch B 13..19; padding 20..23. subtree_end[j]: last token of
    # j's subtree, so query i sees key j iff j <= i <= subtree_end[j].
    end = np.arange(24)
    end[0:6], end[6:9], end[9:11], end[11:13], end[13:20] = 19, 12, 10, 12, 19
    seg = np.r_[np.ones(20, int), np.zeros(4, int)]
    mask = AttentionMask.packed(jnp.asarray(seg[None], jnp.int32), jnp.asarray(end[None]))
    dense = np.asarray(mask.dense()[0])
    assert dense[12, 8] and not dense[12, 10] and not dense[15, 7] and dense[15, 3]
    check_grads(mask, *qkv(1, 24, 24, seed=1))


def test_decode_against_a_cache_equals_dense():
    # two new tokens per row against a 44-slot cache (kv heads major, as the sampler
    # keeps it); the second row's second token is padding (position -1): zeros.
    q, k, v = qkv(2, 2, 44, seed=2)
    k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, K, S, hd]
    mask = AttentionMask.decode(jnp.asarray([[30, 31], [5, -1]], jnp.int32), 44)
    out = jax.jit(
        lambda q, k, v: pallas_tpu_attention(
            q, k, v, mask, block_q=8, block_k=8, kv_heads_major=True, interpret=True
        )
    )(q, k, v)
    ref = dense_attention(q, k, v, mask.dense(), kv_heads_major=True)
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)
    assert jnp.all(out[1, 1] == 0)


def test_refuses_a_sliding_window():
    mask = AttentionMask.packed(
        jnp.ones((1, 8), jnp.int32), positions=jnp.arange(8)[None], window=4
    )
    q = jnp.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match="sliding window"):
        pallas_tpu_attention(q, q, q, mask, interpret=True)


def test_kernel_lowers_for_a_tpu_topology():
    """Mosaic's block rules and lowering: forward and backward compiled for v5e
    (bf16, 128-blocks, a tree row) ahead of time on this CPU host."""
    pytest.importorskip("libtpu", reason="libtpu not installed (pip install ac2_jax[tpu-aot])")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process may hold it
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x2").devices
    one = jax.sharding.SingleDeviceSharding(devices[0])
    B, L, H, K, hd = 1, 256, 4, 2, 128

    def loss(q, k, v, seg, end):
        out = pallas_tpu_attention(q, k, v, AttentionMask.packed(seg, end))
        return jnp.sum(out.astype(jnp.float32))

    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=one)  # noqa: E731
    args = (spec((B, L, H, hd), jnp.bfloat16), *[spec((B, L, K, hd), jnp.bfloat16)] * 2,
            *[spec((B, L), jnp.int32)] * 2)  # fmt: skip
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    assert compiled.as_text().count("tpu_custom_call") == 3  # forward, dq, dk / dv
