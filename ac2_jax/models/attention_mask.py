"""AttentionMask: the structure of a packed-row or KV-cache attention mask.

Query i sees key j iff

    q_index[i] == kv_index[j]                                     (itself)
    or kv_index[j] <= q_index[i] <= kv_end[j] and segments agree

where segments agree means q_segment[i] == kv_segment[j] > 0 for flat rows
and both > 0 for tree rows. `packed` gives exactly
`ac2_jax.losses.attention_mask` (flat rows: causal within a segment; tree
rows: ancestors only, kv_end = subtree_end); `decode` gives the KV-cache
mask (a query at position p sees cache slots 0..p). Blocked kernels read
per-tile bounds of these arrays to skip tiles that are fully masked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

BIG = 2**30  # "no end": kv_end of flat rows; index of padded keys
NEG = -1e30  # finite, so a masked softmax never produces NaN


@struct.dataclass
class AttentionMask:
    """Structure of an attention mask (see the module docstring). All int32.

    q_index, q_segment: [B, Lq]; kv_index, kv_segment, kv_end: [B, Lk].
    Static: `tree`: segments need only be real (> 0), not equal; `causal`:
    self-attention of packed rows (q_index == kv_index == arange), so the
    mask lies inside the causal triangle.
    """

    q_index: jax.Array
    kv_index: jax.Array
    q_segment: jax.Array
    kv_segment: jax.Array
    kv_end: jax.Array
    tree: bool = struct.field(pytree_node=False, default=False)
    causal: bool = struct.field(pytree_node=False, default=False)

    @classmethod
    def packed(cls, segment_ids: jax.Array, subtree_end: jax.Array | None = None) -> AttentionMask:
        """Self-attention of packed rows: segment_ids [B, L] (0 = padding), subtree_end
        [B, L] for tree rows (DFS layout) or None for flat rows."""
        seg = segment_ids.astype(jnp.int32)
        idx = jnp.broadcast_to(jnp.arange(seg.shape[-1], dtype=jnp.int32), seg.shape)
        end = jnp.full_like(seg, BIG) if subtree_end is None else subtree_end.astype(jnp.int32)
        return cls(idx, idx, seg, seg, end, tree=subtree_end is not None, causal=True)

    @classmethod
    def decode(cls, positions: jax.Array, max_len: int) -> AttentionMask:
        """T new tokens at positions [B, T] (-1 = padding) against cache slots 0..max_len-1."""
        pos = positions.astype(jnp.int32)
        B = pos.shape[0]
        slots = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (B, max_len))
        ones = jnp.ones((B, max_len), jnp.int32)
        return cls(pos, slots, (pos >= 0).astype(jnp.int32), ones, jnp.full_like(ones, BIG))

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, Lq, Lk)."""
        b, lq = self.q_index.shape
        return (b, lq, self.kv_index.shape[1])

    def dense(self) -> jax.Array:
        """The mask as [B, Lq, Lk] bool (True = may attend)."""
        qi, ki = self.q_index[:, :, None], self.kv_index[:, None, :]
        qs, ks = self.q_segment[:, :, None], self.kv_segment[:, None, :]
        seg = (qs > 0) & (ks > 0) if self.tree else (qs == ks) & (qs > 0)
        return (qi == ki) | ((ki <= qi) & (qi <= self.kv_end[:, None, :]) & seg)

    def pad(self, lq: int, lk: int) -> AttentionMask:
        """Padded to lq queries / lk keys; the added ones see / are seen by nothing."""
        B, Lq, Lk = self.shape
        if lq < Lq or lk < Lk:
            raise ValueError(f"AttentionMask.pad: cannot shrink ({Lq}, {Lk}) to ({lq}, {lk})")

        def p(x, n, value):  # noqa: E306
            return jnp.pad(x, ((0, 0), (0, n - x.shape[1])), constant_values=value)

        return AttentionMask(
            p(self.q_index, lq, -1),
            p(self.kv_index, lk, BIG),
            p(self.q_segment, lq, 0),
            p(self.kv_segment, lk, 0),
            p(self.kv_end, lk, -1),
            tree=self.tree,
            causal=self.causal and lq == lk,
        )

    def tiles(self, block_q: int, block_k: int) -> jax.Array:
        """[B, Lq // block_q, Lk // block_k] bool: False where a tile is surely fully
        masked (a superset of the tiles with a visible pair; exact for flat rows whose
        segments are contiguous runs). Lq, Lk must be multiples of the blocks."""
        B, Lq, Lk = self.shape
        if Lq % block_q or Lk % block_k:
            raise ValueError(
                f"AttentionMask.tiles: lengths ({Lq}, {Lk}) must be multiples of "
                f"the blocks ({block_q}, {block_k}); pad() first"
            )

        def blocks(x, b, fn):  # [B, L] -> [B, L // b] per-block reduction
            return fn(x.reshape(B, -1, b), axis=-1)

        q_lo, q_hi = blocks(self.q_index, block_q, jnp.min), blocks(self.q_index, block_q, jnp.max)
        k_lo, k_hi = (
            blocks(self.kv_index, block_k, jnp.min),
            blocks(self.kv_index, block_k, jnp.max),
        )
        end_hi = blocks(self.kv_end, block_k, jnp.max)
        qs, ks = self.q_segment, self.kv_segment
        qs_lo = blocks(jnp.where(qs > 0, qs, BIG), block_q, jnp.min)
        qs_hi = blocks(jnp.where(qs > 0, qs, -1), block_q, jnp.max)
        ks_lo = blocks(jnp.where(ks > 0, ks, BIG), block_k, jnp.min)
        ks_hi = blocks(jnp.where(ks > 0, ks, -1), block_k, jnp.max)
        Q = lambda x: x[:, :, None]  # noqa: E731  (q blocks down, k blocks across)
        K = lambda x: x[:, None, :]  # noqa: E731
        itself = (Q(q_lo) <= K(k_hi)) & (K(k_lo) <= Q(q_hi))
        reach = (K(k_lo) <= Q(q_hi)) & (K(end_hi) >= Q(q_lo))
        if self.tree:
            seg = (Q(qs_hi) > 0) & (K(ks_hi) > 0)
        else:
            seg = (Q(qs_lo) <= K(ks_hi)) & (K(ks_lo) <= Q(qs_hi))
        return itself | (reach & seg)
