"""token_logprobs / token_entropy against numpy; multi-device."""

import jax
import numpy as np

from ac2_jax.losses import token_entropy, token_logprobs
from tests.multidevice import run_mesh_rows, run_pmap_rows


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_against_numpy_and_multidevice():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (8, 5, 11)).astype(np.float32)
    targets = rng.integers(0, 11, (8, 5))
    ref = np.take_along_axis(_np_log_softmax(logits), targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(token_logprobs(logits, targets), ref, rtol=1e-5, atol=1e-6)
    lsm = _np_log_softmax(logits)
    np.testing.assert_allclose(token_entropy(logits), -(np.exp(lsm) * lsm).sum(-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.jit(token_logprobs)(logits, targets), ref, rtol=1e-5, atol=1e-6)
    pm = run_pmap_rows(lambda l, t, axis_name: token_logprobs(l, t), logits, targets)
    np.testing.assert_allclose(np.asarray(pm).reshape(ref.shape), ref, rtol=1e-5, atol=1e-6)
    meshed, _ = run_mesh_rows(token_logprobs, logits, targets)
    np.testing.assert_allclose(np.asarray(meshed), ref, rtol=1e-5, atol=1e-6)
