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
    assert pick("auto", "tpu") == "pallas_tpu"  # the one TPU kernel for every mask
    assert pick("auto", "tpu", kind="tree") == "pallas_tpu"
    assert pick("auto", "tpu", kind="decode", q_len=1) == "pallas_tpu"
    # Explicit choices stand, except the segment-id kernels off flat rows.
    assert pick("blocksparse", "gpu") == "blocksparse" and pick("dense", "cpu") == "dense"
    assert pick("pallas_gpu", "gpu", kind="tree") == "dense"
    assert pick("splash_tpu", "tpu", kind="decode", q_len=1) == "dense"
    assert pick("splash_tpu", "tpu") == "splash_tpu"
    assert pick("pallas_tpu", "cpu", kind="tree") == "pallas_tpu"
    assert set(ATTENTION_BACKENDS) == {"auto", "dense", "blocksparse", "cudnn", "pallas_gpu",
                                       "splash_tpu", "pallas_tpu"}


def test_auto_reads_the_platform_of_the_mesh_set():
    """Ahead-of-time compilation for TPU runs on a CPU host: "auto" follows the mesh
    set with jax.set_mesh (its devices' platform), not jax.default_backend()."""
    from jax._src.mesh import AbstractDevice  # what a TPU topology's mesh carries

    from ac2_jax.models.kernels.attention import target_platform

    assert target_platform() == "cpu"
    mesh = jax.sharding.AbstractMesh((2,), ("data",))  # devices unknown: the default backend
    with jax.sharding.use_abstract_mesh(mesh):
        assert target_platform() == "cpu"
    tpu = AbstractDevice(device_kind="TPU v5 lite", num_cores=None, platform="tpu")
    mesh = jax.sharding.AbstractMesh((2,), ("data",), abstract_device=tpu)
    with jax.sharding.use_abstract_mesh(mesh):
        assert target_platform() == "tpu"
        assert pick("auto", None, kind="tree") == "pallas_tpu"


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


def _reference(q, k, v, mask):
    """Grouped-query masked softmax attention in float64 numpy; k, v [B, S, K, hd]."""
    q, k, v, mask = (np.asarray(a, np.float64) for a in (q, k, v, mask))
    B, L, H, hd = q.shape
    rep = H // k.shape[2]
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    s = np.einsum("blhd,bshd->bhls", q, k) / np.sqrt(hd)
    s = np.where(mask[:, None], s, -1e30)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    out = np.einsum("bhls,bshd->blhd", np.nan_to_num(p), v)
    return np.where(mask.any(-1)[:, :, None, None], out, 0.0)


@pytest.mark.parametrize("q_len", [1, 5])
def test_heads_major_kv_equals_reference(q_len):
    """k, v stored [B, K, S, hd] (the per-layer KV cache) give the same attention as
    [B, S, K, hd] and as a float64 reference, for a decode step (q_len 1, the
    einsum path without a transposed copy) and a prefill chunk; fp32, atol 1e-5."""
    from ac2_jax.models import dense_attention
    rng = np.random.default_rng(0)
    B, S, H, K, hd = 3, 24, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(B, q_len, H, hd)), F32)
    k, v = (jnp.asarray(rng.normal(size=(B, S, K, hd)), F32) for _ in range(2))
    pos = jnp.asarray(rng.integers(0, S, (B, q_len))).at[1].set(-1)  # row 1 sees nothing
    mask = AttentionMask.decode(pos, S)
    want = _reference(q, k, v, mask.dense())
    kt, vt = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
    for got in (dense_attention(q, k, v, mask.dense()),
                dense_attention(q, kt, vt, mask.dense(), kv_heads_major=True),
                attention(q, kt, vt, mask, backend="dense", kv_heads_major=True),
                attention(q, kt, vt, mask, backend="blocksparse", block=8,
                          kv_heads_major=True)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
