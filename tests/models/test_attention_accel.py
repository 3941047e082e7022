"""The accelerator backends' wrappers, run in Pallas interpret mode on CPU
against the dense reference (fp32, atol 1e-5; values and gradients): segment
ids, padding, GQA head repeat, scaling and row padding are ours to get right.
The kernels themselves are untested here on their devices; cuDNN has no CPU
mode (only its input check is tested)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ac2_jax.models import AttentionMask, dense_attention
from ac2_jax.models.kernels.attention_accel import (
    cudnn_attention,
    pallas_gpu_attention,
    splash_tpu_attention,
)

TOL = 1e-5


def case(L, hd, seed=0):
    rng = np.random.default_rng(seed)
    seg = np.repeat([1, 2, 3, 0], [L // 3, L // 4, L // 4, L - L // 3 - 2 * (L // 4)])
    mask = AttentionMask.packed(jnp.asarray(seg[None], jnp.int32))
    q = jnp.asarray(rng.standard_normal((1, L, 4, hd)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, L, 2, hd)), jnp.float32) for _ in range(2))
    return mask, q, k, v


def check(kernel, mask, q, k, v):
    w = jnp.asarray(np.random.default_rng(7).standard_normal(q.shape), jnp.float32)

    def grads(attend):
        loss = lambda q, k, v: (jnp.sum(attend(q, k, v) * w), attend(q, k, v))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    got, out = grads(kernel)
    want, ref = grads(lambda q, k, v: dense_attention(q, k, v, mask.dense()))
    np.testing.assert_allclose(out, ref, atol=TOL, rtol=0)
    for name, g, r in zip("qkv", got, want):
        np.testing.assert_allclose(g, r, atol=TOL, rtol=0, err_msg=f"d{name}")


def test_pallas_gpu_wrapper_in_interpret_mode_equals_dense():
    mask, q, k, v = case(50, 16)  # 50: padded to the 32-token blocks inside
    check(lambda q, k, v: pallas_gpu_attention(q, k, v, mask, block=32, interpret=True),
          mask, q, k, v)


def test_splash_tpu_wrapper_in_interpret_mode_equals_dense():
    mask, q, k, v = case(200, 128, seed=1)  # 200: padded to a 128-token block multiple
    out = jax.jit(lambda q, k, v: splash_tpu_attention(q, k, v, mask, interpret=True))(q, k, v)
    np.testing.assert_allclose(out, dense_attention(q, k, v, mask.dense()), atol=TOL, rtol=0)


def test_wrappers_refuse_masks_they_do_not_fit():
    tree = AttentionMask.packed(jnp.ones((1, 8), jnp.int32), jnp.full((1, 8), 7, jnp.int32))
    decode = AttentionMask.decode(jnp.zeros((1, 1), jnp.int32), 8)
    q = jnp.zeros((1, 8, 2, 8))
    for fn in (pallas_gpu_attention, splash_tpu_attention):
        for mask in (tree, decode):
            with pytest.raises(ValueError, match="flat packed rows only"):
                fn(q[:, :mask.shape[1]], q, q, mask)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        cudnn_attention(q, q, q, AttentionMask.packed(jnp.ones((1, 8), jnp.int32)))
