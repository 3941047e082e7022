"""models.layers' pure pieces: RoPE tables built once per forward (`rope_cos_sin` +
`rotate`) equal HF's rotate-half RoPE computed per call (fp32; atol 1e-5 against a
numpy reference, 1e-6 against per-call `apply_rope`)."""

import jax.numpy as jnp
import numpy as np

from ac2_jax.models import DecoderConfig
from ac2_jax.models.layers import apply_rope, rope_cos_sin, rope_inv_freq, rotate


def _rope_reference(x, positions, inv_freq):
    """HF's apply_rotary_pos_emb in numpy: angles in fp32 as HF forms them, the
    rotation in float64. x [B, L, H, hd], positions [B, L]."""
    x = np.asarray(x, np.float64)
    freqs = (np.asarray(positions, np.float32)[..., None]
             * np.asarray(inv_freq, np.float32)).astype(np.float64)
    emb = np.concatenate([freqs, freqs], -1)[:, :, None]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def test_shared_rope_tables_equal_per_call_rope():
    c = DecoderConfig.tiny(head_dim=16, rope_theta=10000.0)
    inv = jnp.asarray(rope_inv_freq(c))
    rng = np.random.default_rng(0)
    pos = jnp.asarray(rng.integers(0, 300, (2, 7)), jnp.int32)
    tables = rope_cos_sin(pos, inv)
    assert tables[0].shape == tables[1].shape == (2, 7, 1, 16)
    for heads in (4, 2):  # q and k share one table (broadcast over heads)
        x = jnp.asarray(rng.normal(size=(2, 7, heads, 16)), jnp.float32)
        want = _rope_reference(x, pos, inv)
        np.testing.assert_allclose(rotate(x, tables), want, atol=1e-5, rtol=0)
        np.testing.assert_allclose(rotate(x, tables), apply_rope(x, pos, inv), atol=1e-6, rtol=0)
