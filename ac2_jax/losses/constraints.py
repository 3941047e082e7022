"""Grammar masks on the learner's logits (pure, jit-able).

A grammar-constrained token was drawn from logits -> ids outside the allowed
set set to -inf -> `sampling_logits` -> log_softmax. `constrain_logits` is
the first step, for every position at once: a position whose constraint id
is k >= 1 keeps the ids of row k - 1 of the batch's mask table and gets -inf
elsewhere; id 0 positions keep their logits exactly (`jnp.where` picks the
same value). `token_logprobs` / `chunked_token_logprobs` apply it before the
sampling transform when given `constraint_ids` and `constraint_masks`.

Masks are packed bits, uint32 [K, W] with W = ceil(V / 32): token v is
allowed iff bit v % 32 of word v // 32 is set (`ac2_jax.segments.mask_bits`
packs them on the host). A table narrower than the vocabulary (masks over
the tokenizer's ids, the model's head padded past them) disallows the ids
past it, as the sampler does.

Masking in place costs one elementwise pass over the logits a position
already has (dense or one chunk at a time): no gather of hidden states, no
second projection, no cap on how many positions are constrained, and rows
sharded over devices stay where they are (the table is small and replicated).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def unpack_masks(words: jax.Array, vocab_size: int) -> jax.Array:
    """uint32 bit words [..., W] -> bool [..., vocab_size] (ids past 32 W: False)."""
    W = words.shape[-1]
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (words.astype(jnp.uint32)[..., None] >> shifts) & jnp.uint32(1)  # [..., W, 32]
    bits = bits.reshape(*words.shape[:-1], W * 32).astype(bool)
    if W * 32 >= vocab_size:
        return bits[..., :vocab_size]
    pad = jnp.zeros((*words.shape[:-1], vocab_size - W * 32), bool)
    return jnp.concatenate([bits, pad], axis=-1)


def _check_table(masks, vocab_size: int, who: str) -> None:
    """Raises unless `masks` is a uint32 [K, W] table with W <= ceil(vocab_size / 32)."""
    if masks.ndim != 2 or masks.dtype != jnp.uint32:
        raise ValueError(
            f"{who}: constraint_masks must be packed bits uint32 [K, W], got "
            f"{masks.dtype} {masks.shape} (ac2_jax.segments.pack_mask_bits)"
        )
    if masks.shape[1] > -(-vocab_size // 32):
        raise ValueError(
            f"{who}: constraint_masks rows hold {masks.shape[1]} words ({masks.shape[1] * 32} "
            f"ids), more than the logits' {vocab_size} ids need; the masks were replayed over "
            "another vocabulary than the model's (pass the model's vocab_size)"
        )


def constrain_logits(
    logits: jax.Array,
    constraint_ids: jax.Array,
    constraint_masks: jax.Array,
    *,
    keep: jax.Array | None = None,
) -> jax.Array:
    """fp32 logits with each constrained position's disallowed ids at -inf.

    logits [..., V]; constraint_ids [...] int (0: unconstrained, k >= 1: row
    k - 1 of constraint_masks); constraint_masks uint32 [K, W]. `keep` [...]
    int: an id kept whatever the mask says (the learner passes the target, so
    a mismatch can never make a log-prob -inf; the host already checked that
    every constrained target is allowed). Returns [..., V]; positions with id 0
    are `logits` unchanged.
    """
    V = logits.shape[-1]
    _check_table(constraint_masks, V, "constrain_logits")
    if tuple(constraint_ids.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"constrain_logits: constraint_ids {constraint_ids.shape} must be "
            f"logits.shape[:-1] = {logits.shape[:-1]}"
        )
    ids = constraint_ids.astype(jnp.int32)
    rows = jnp.take(constraint_masks, jnp.maximum(ids - 1, 0), axis=0, mode="clip")
    allowed = unpack_masks(rows, V) | (ids <= 0)[..., None]
    if keep is not None:
        allowed = allowed | (jnp.arange(V) == keep.astype(jnp.int32)[..., None])
    return jnp.where(allowed, logits.astype(jnp.float32), -jnp.inf)
