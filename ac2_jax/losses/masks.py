"""Attention masks for packed rows (pure, jit-able).

Flat packing: a token sees the earlier tokens of its own segment. Tree
packing (shared prefixes laid out depth-first): a token sees exactly its
ancestors, and k is an ancestor-or-self of q iff k <= q <= subtree_end[k].
Every token sees itself, so padding rows never softmax over nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_attention_mask(segment_ids: jax.Array) -> jax.Array:
    """Causal, no attention across segments. [..., L] -> [..., L(q), L(k)] bool."""
    L = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((L, L), dtype=bool))
    same = segment_ids[..., :, None] == segment_ids[..., None, :]
    real = (segment_ids[..., :, None] > 0) & (segment_ids[..., None, :] > 0)
    return (causal & same & real) | jnp.eye(L, dtype=bool)


def tree_attention_mask(subtree_end: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Ancestor mask from DFS subtree ends. [..., L] -> [..., L(q), L(k)] bool."""
    L = subtree_end.shape[-1]
    q = jnp.arange(L)[:, None]
    k = jnp.arange(L)[None, :]
    ancestor = (k <= q) & (q <= subtree_end[..., None, :])
    real = (segment_ids[..., :, None] > 0) & (segment_ids[..., None, :] > 0)
    return (ancestor & real) | jnp.eye(L, dtype=bool)


def attention_mask(segment_ids: jax.Array, subtree_end: jax.Array | None = None) -> jax.Array:
    """The mask of a packed row: tree when `subtree_end` is given, else flat."""
    if subtree_end is None:
        return segment_attention_mask(segment_ids)
    return tree_attention_mask(subtree_end, segment_ids)
