"""The attention dispatcher: which backend "auto" picks per platform and shape,
that the dispatcher's backends agree (fp32, atol 1e-5), and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ac2_jax.models import ATTENTION_BACKENDS, AttentionMask, attention, choose_backend

F32, BF16 = jnp.float32, jnp.bfloat16


def pick(requested, platform, kind="flat", q_len=1024, dtype=F32, head_dim=128, block=128):
    return choose_backend(requested, kind=kind, q_len=q_len, dtype=dtype, head_dim=head_dim,
                          block=block, platform=platform)


def test_auto_picks_by_platform_and_shape():
    assert pick("auto", "cpu") == "blocksparse"
    assert pick("auto", "cpu", kind="tree", q_len=512) == "blocksparse"
    assert pick("auto", "cpu", q_len=256) == "dense"           # short rows: dense
    assert pick("auto", "cpu", kind="decode", q_len=1) == "dense"
    assert pick("auto", "gpu", dtype=BF16) == "cudnn"
    assert pick("auto", "gpu", kind="tree", dtype=BF16) == "cudnn"
    assert pick("auto", "gpu") == "dense"                      # cuDNN takes no fp32
    assert pick("auto", "gpu", dtype=BF16, head_dim=256) == "dense"
    assert pick("auto", "gpu", kind="decode", q_len=1, dtype=BF16) == "dense"
    assert pick("auto", "tpu") == "splash_tpu"
    assert pick("auto", "tpu", kind="tree") == "dense"
    # Explicit choices stand, except the segment-id kernels off flat rows.
    assert pick("blocksparse", "gpu") == "blocksparse" and pick("dense", "cpu") == "dense"
    assert pick("pallas_gpu", "gpu", kind="tree") == "dense"
    assert pick("splash_tpu", "tpu", kind="decode", q_len=1) == "dense"
    assert pick("splash_tpu", "tpu") == "splash_tpu"
    assert set(ATTENTION_BACKENDS) == {"auto", "dense", "blocksparse", "cudnn", "pallas_gpu",
                                       "splash_tpu"}


def test_dispatched_backends_agree():
    rng = np.random.default_rng(0)
    seg = np.repeat([1, 2, 3, 0], [20, 9, 25, 10])[None].repeat(2, 0).astype(np.int32)
    mask = AttentionMask.packed(jnp.asarray(seg))
    q = jnp.asarray(rng.standard_normal((2, 64, 4, 8)), F32)
    k, v = (jnp.asarray(rng.standard_normal((2, 64, 2, 8)), F32) for _ in range(2))
    run = jax.jit(lambda mask, backend: attention(q, k, v, mask, backend=backend, block=16),
                  static_argnums=1)
    ref = run(mask.dense(), "dense")  # the dense array form
    np.testing.assert_allclose(run(mask, "dense"), ref, atol=1e-5, rtol=0)
    np.testing.assert_allclose(run(mask, "blocksparse"), ref, atol=1e-5, rtol=0)
    assert jnp.abs(ref[:, 54:]).max() > 0  # padding tokens see themselves


def test_errors_name_the_fix():
    q = jnp.zeros((1, 8, 2, 8))
    mask = AttentionMask.packed(jnp.ones((1, 8), jnp.int32))
    with pytest.raises(ValueError, match="needs an AttentionMask"):
        attention(q, q, q, mask.dense(), backend="blocksparse")
    with pytest.raises(ValueError, match="choose_backend"):
        attention(q, q, q, mask, backend="auto")
    with pytest.raises(ValueError, match="must be one of"):
        pick("flash", "cpu")
    with pytest.raises(ValueError, match="kind"):
        pick("auto", "cpu", kind="packed")
    assert jax.default_backend() == "cpu"  # the GPU / TPU picks above are by name only
