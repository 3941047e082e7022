"""A batch of logits with hand-made grammar masks, for the tests of the learner's
masked log-probs (tests/losses/test_losses_constraints.py, test_logprobs.py, test_chunked.py).

`constrained_case(seed)`: logits from hidden states and a head, K distinct masks
(about half the vocabulary each), ids putting about half the positions under one,
per-position sampling parameters, targets drawn from the masked sampling
distribution. `masked_reference(case)`: what the sampler records for them,
log_softmax(sampling_logits(masked logits))[target].
"""

import jax
import jax.numpy as jnp
import numpy as np

from ac2_jax.losses import LMHead, sampling_logits
from ac2_jax.segments import pack_mask_bits

R, L, D, V, K = 2, 12, 16, 70, 4


def constrained_case(seed=0):
    """Logits, masks (K distinct, ~half the vocabulary), ids (about half the positions
    constrained), sampling params per position, and targets drawn from the masked
    sampling distribution."""
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(R, L, D)), jnp.float32)
    head = LMHead(jnp.asarray(rng.normal(size=(D, V)) * 0.7, jnp.float32))
    logits = head.logits(hidden)
    masks = rng.random((K, V)) < 0.5
    ids = np.where(rng.random((R, L)) < 0.5, rng.integers(1, K + 1, (R, L)), 0).astype(np.int32)
    t = rng.choice([0.7, 1.0, 1.3], (R, L)).astype(np.float32)
    k = rng.choice([0, 5, 20], (R, L)).astype(np.int32)
    p = rng.choice([1.0, 0.9], (R, L)).astype(np.float32)
    allowed = np.where(ids[..., None] > 0, masks[np.maximum(ids - 1, 0)], True)
    drawn = sampling_logits(jnp.where(allowed, logits, -jnp.inf), t, k, p)
    targets = np.asarray(jax.random.categorical(jax.random.key(seed), drawn), np.int32)
    return dict(hidden=hidden, head=head, logits=logits, masks=masks, ids=ids, t=t, k=k, p=p,
                allowed=allowed, targets=targets, table=jnp.asarray(pack_mask_bits(masks)))


def masked_reference(c):
    """What the sampler records: logits -> mask -> sampling_logits -> log_softmax."""
    masked = jnp.where(c["allowed"], c["logits"], -jnp.inf)
    lp = jax.nn.log_softmax(sampling_logits(masked, c["t"], c["k"], c["p"]), axis=-1)
    return np.asarray(jnp.take_along_axis(lp, c["targets"][..., None], axis=-1)[..., 0])


