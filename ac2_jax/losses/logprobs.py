"""Per-token log-probs and entropies from logits (pure, jit-able)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log p(targets) under softmax(logits), in fp32.

    logits: [..., L, V]; targets: [..., L] int. Returns [..., L].
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - lse


def token_entropy(logits: jax.Array) -> jax.Array:
    """Entropy of softmax(logits) per position. [..., L, V] -> [..., L]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)
