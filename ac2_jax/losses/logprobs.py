"""Per-token log-probs and entropies from logits (pure, jit-able).

`sampling_logits` is the one definition of "the distribution a sampler draws
from" (temperature, then top-k, then top-p). The JaxSampler samples from it
and records its log-probs; the learner scores tokens with the same function
(`token_logprobs(..., temperature=, top_k=, top_p=)`), so an on-policy PPO
ratio is exactly 1 whatever the sampling parameters.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ac2_jax.losses.constraints import constrain_logits


def _filter(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, keep) -> jax.Array:
    V = logits.shape[-1]
    srt = -jnp.sort(-logits, axis=-1)  # descending
    rank = jnp.arange(V)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)[..., None]
    in_k = rank < k
    probs = jax.nn.softmax(jnp.where(in_k, srt, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    tp = top_p[..., None]
    in_p = (mass_before < tp) | (tp >= 1.0) | (rank == 0)
    n_keep = jnp.sum(in_k & in_p, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(srt, n_keep - 1, axis=-1)
    kept = logits >= threshold
    if keep is not None:
        kept = kept | (rank == keep[..., None])
    return jnp.where(kept, logits, -jnp.inf)


def sampling_logits(
    logits: jax.Array, temperature=1.0, top_k=0, top_p=1.0, *, keep: jax.Array | None = None
) -> jax.Array:
    """fp32 logits of the sampling distribution: logits / T, then top-k, then top-p.

    logits [..., V]; temperature, top_k, top_p: scalars or [...] arrays (one per
    position). temperature <= 0 (greedy: no distribution) scales by 1. top_k
    <= 0 and top_p >= 1 are off; removed entries become -inf; ties with the
    last kept logit are kept. `keep` [...] int: ids kept whatever the filters
    say (the learner passes the sampled token, so a token the sampler kept can
    never score -inf from a last-bit difference in the logits).
    """
    logits = logits.astype(jnp.float32)
    batch = logits.shape[:-1]
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), batch)
    k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), batch)
    p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), batch)
    scaled = logits / jnp.where(t > 0, t, 1.0)[..., None]
    needs_filter = jnp.any((k > 0) | (p < 1.0))
    return jax.lax.cond(needs_filter, lambda x: _filter(x, k, p, keep), lambda x: x, scaled)


def token_logprobs(
    logits: jax.Array,
    targets: jax.Array,
    *,
    temperature=None,
    top_k=None,
    top_p=None,
    constraint_ids: jax.Array | None = None,
    constraint_masks: jax.Array | None = None,
) -> jax.Array:
    """log p(targets) in fp32, under softmax(logits) or the sampling distribution.

    logits: [..., L, V]; targets: [..., L] int. With any of temperature /
    top_k / top_p given (scalars or [..., L]), p is `sampling_logits`'s
    distribution (the target is always kept). With constraint_masks (uint32
    [K, W]) and constraint_ids ([..., L]), grammar-constrained positions are
    masked first (`constrain_logits`), as the sampler drew them: mask, then
    the sampling transform, then log_softmax. Returns [..., L].
    """
    targets = targets.astype(jnp.int32)
    if (constraint_ids is None) != (constraint_masks is None):
        raise ValueError(
            "token_logprobs: constraint_ids and constraint_masks go together "
            "(a per-position id into a table of masks); pass both or neither"
        )
    if constraint_ids is not None and constraint_masks is not None:
        logits = constrain_logits(logits, constraint_ids, constraint_masks, keep=targets)
    if temperature is None and top_k is None and top_p is None:
        logits = logits.astype(jnp.float32)
    else:
        logits = sampling_logits(
            logits,
            1.0 if temperature is None else temperature,
            0 if top_k is None else top_k,
            1.0 if top_p is None else top_p,
            keep=targets,
        )
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - lse


def token_entropy(logits: jax.Array) -> jax.Array:
    """Entropy of softmax(logits) per position. [..., L, V] -> [..., L]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)
