"""constraints: grammar masks on the learner's logits (unpacking, masking, gradients,
errors). The log-probs through them: test_logprobs.py (dense), test_chunked.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ac2_jax.losses import (
    chunked_token_logprobs,
    constrain_logits,
    sampling_logits,
    token_logprobs,
    unpack_masks,
)
from ac2_jax.segments import pack_mask_bits, unpack_mask_bits
from tests.support.constrained_case import L, R, constrained_case


@pytest.mark.parametrize("V_", [1, 32, 70, 100])
def test_unpack_masks_matches_the_host_packing(V_):
    m = np.random.default_rng(V_).random((3, V_)) < 0.5
    words = pack_mask_bits(m)
    np.testing.assert_array_equal(np.asarray(unpack_masks(jnp.asarray(words), V_)), m)
    # A table narrower than the logits (the tokenizer's ids, a padded head): the rest is out.
    wide = np.asarray(unpack_masks(jnp.asarray(words), V_ + 40))
    np.testing.assert_array_equal(wide, unpack_mask_bits(words, V_ + 40))
    assert not wide[:, V_:].any()


def test_constrain_logits_masks_only_constrained_positions():
    c = constrained_case()
    out = np.asarray(constrain_logits(c["logits"], jnp.asarray(c["ids"]), c["table"]))
    np.testing.assert_array_equal(np.isfinite(out), c["allowed"])
    free = c["ids"] == 0
    np.testing.assert_array_equal(out[free], np.asarray(c["logits"])[free])
    kept = constrain_logits(c["logits"], jnp.asarray(c["ids"]), c["table"],
                            keep=jnp.zeros((R, L), jnp.int32))
    assert np.isfinite(np.asarray(kept)[..., 0]).all()


def test_gradients_flow_through_allowed_logits_only_and_are_finite():
    c = constrained_case(3)
    params = dict(temperature=c["t"], top_k=c["k"], top_p=c["p"])

    def loss(lg):
        return token_logprobs(lg, c["targets"], **params, constraint_ids=jnp.asarray(c["ids"]),
                              constraint_masks=c["table"]).sum()

    def direct(lg):
        masked = jnp.where(c["allowed"], lg, -jnp.inf)
        lp = jax.nn.log_softmax(sampling_logits(masked, c["t"], c["k"], c["p"]), axis=-1)
        return jnp.take_along_axis(lp, c["targets"][..., None], axis=-1).sum()

    g = np.asarray(jax.grad(loss)(c["logits"]))
    assert np.isfinite(g).all() and not g[~c["allowed"]].any()
    np.testing.assert_allclose(g, np.asarray(jax.grad(direct)(c["logits"])), rtol=0, atol=1e-6)


def test_errors_name_the_problem():
    c = constrained_case()
    ids, table = jnp.asarray(c["ids"]), c["table"]
    with pytest.raises(ValueError, match="go together"):
        token_logprobs(c["logits"], c["targets"], constraint_ids=ids)
    with pytest.raises(ValueError, match="go together"):
        chunked_token_logprobs(c["hidden"], c["head"], c["targets"], chunk_size=4,
                               constraint_masks=table)
    with pytest.raises(ValueError, match="another vocabulary"):
        constrain_logits(c["logits"], ids, jnp.zeros((2, 4), jnp.uint32))
    with pytest.raises(ValueError, match="uint32"):
        constrain_logits(c["logits"], ids, jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="constraint_ids"):
        constrain_logits(c["logits"], ids[:, :3], table)
