"""token_logprobs / token_entropy against numpy; multi-device."""

import jax
import numpy as np
import pytest

from ac2_jax.losses import token_entropy, token_logprobs
from tests.support.constrained_case import constrained_case, masked_reference
from tests.support.multidevice import run_mesh_rows, run_pmap_rows


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


# Grammar-constrained positions (constraint_ids + constraint_masks): logits -> mask ->
# sampling_logits -> log_softmax, as the sampler drew them (fp32, atol 1e-6).
@pytest.mark.parametrize("sampling", [True, False])
def test_dense_logprobs_equal_the_masked_sampling_distribution(sampling):
    c = constrained_case(1)
    params = dict(temperature=c["t"], top_k=c["k"], top_p=c["p"]) if sampling else {}
    if not sampling:
        c = {**c, "t": 1.0, "k": 0, "p": 1.0}
    f = jax.jit(lambda lg, y, ids, tab: token_logprobs(
        lg, y, **params, constraint_ids=ids, constraint_masks=tab))
    got = np.asarray(f(c["logits"], c["targets"], c["ids"], c["table"]))
    on = c["ids"] > 0
    assert on.sum() >= 8 and (~on).sum() >= 8
    np.testing.assert_allclose(got[on], masked_reference(c)[on], rtol=0, atol=1e-6)
    # Unconstrained positions: bit for bit the unmasked call.
    plain = np.asarray(jax.jit(lambda lg, y: token_logprobs(lg, y, **params))(
        c["logits"], c["targets"]))
    np.testing.assert_array_equal(got[~on], plain[~on])
    # The mask matters here: unmasked scores differ at constrained positions.
    assert np.abs(plain[on] - got[on]).max() > 0.05
