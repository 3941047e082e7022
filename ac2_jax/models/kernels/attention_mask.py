"""AttentionMask: the structure of a packed-row or KV-cache attention mask.

Query i sees key j iff

    q_index[i] == kv_index[j]                                     (itself)
    or kv_index[j] <= q_index[i] <= kv_end[j] and segments agree

where segments agree means q_segment[i] == kv_segment[j] > 0 for flat rows
and both > 0 for tree rows. With a sliding `window` w (Mistral), key j must
also be within it: q_pos[i] - kv_pos[j] < w, by the tokens' positions
(q_pos / kv_pos; default q_index / kv_index), which restart per segment. `packed` gives exactly
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
    mask lies inside the causal triangle. `window`: None, or the sliding
    window over positions q_pos / kv_pos ([B, Lq] / [B, Lk]; None = the
    indices).
    """

    q_index: jax.Array
    kv_index: jax.Array
    q_segment: jax.Array
    kv_segment: jax.Array
    kv_end: jax.Array
    tree: bool = struct.field(pytree_node=False, default=False)
    causal: bool = struct.field(pytree_node=False, default=False)
    q_pos: jax.Array | None = None
    kv_pos: jax.Array | None = None
    window: int | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def packed(
        cls,
        segment_ids: jax.Array,
        subtree_end: jax.Array | None = None,
        *,
        positions: jax.Array | None = None,
        window: int | None = None,
    ) -> AttentionMask:
        """Self-attention of packed rows: segment_ids [B, L] (0 = padding), subtree_end
        [B, L] for tree rows (DFS layout) or None for flat rows. With a sliding
        `window`, `positions` [B, L] (restarting per segment) measure it."""
        seg = segment_ids.astype(jnp.int32)
        idx = jnp.broadcast_to(jnp.arange(seg.shape[-1], dtype=jnp.int32), seg.shape)
        end = jnp.full_like(seg, BIG) if subtree_end is None else subtree_end.astype(jnp.int32)
        pos = None
        if window is not None:
            if positions is None:
                raise ValueError("AttentionMask.packed: a sliding window needs the positions")
            pos = positions.astype(jnp.int32)
        return cls(
            idx, idx, seg, seg, end, subtree_end is not None, True, pos, pos, _window(window)
        )

    @classmethod
    def decode(cls, positions: jax.Array, max_len: int, window: int | None = None) -> AttentionMask:
        """T new tokens at positions [B, T] (-1 = padding) against cache slots
        0..max_len-1 (slot p holds position p), within `window` when given."""
        pos = positions.astype(jnp.int32)
        B = pos.shape[0]
        slots = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (B, max_len))
        ones = jnp.ones((B, max_len), jnp.int32)
        return cls(
            pos,
            slots,
            (pos >= 0).astype(jnp.int32),
            ones,
            jnp.full_like(ones, BIG),
            window=_window(window),
        )

    @property
    def query_pos(self) -> jax.Array:
        return self.q_index if self.q_pos is None else self.q_pos

    @property
    def key_pos(self) -> jax.Array:
        return self.kv_index if self.kv_pos is None else self.kv_pos

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, Lq, Lk)."""
        b, lq = self.q_index.shape
        return (b, lq, self.kv_index.shape[1])

    def dense(self) -> jax.Array:
        """The mask as [B, Lq, Lk] bool (True = may attend)."""
        qi, ki = self.q_index[:, :, None], self.kv_index[:, None, :]
        qs, ks = self.q_segment[:, :, None], self.kv_segment[:, None, :]
        return visible(
            self, qi, ki, qs, ks, self.kv_end[:, None, :],
            self.query_pos[:, :, None], self.key_pos[:, None, :],
        )  # fmt: skip

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
            q_pos=None if self.q_pos is None else p(self.q_pos, lq, BIG),  # outside every window
            kv_pos=None if self.kv_pos is None else p(self.kv_pos, lk, 0),
            window=self.window,
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
        out = itself | (reach & seg)
        if self.window is not None:  # every pair has q_pos - kv_pos >= q_lo - kv_hi
            qp_lo = blocks(self.query_pos, block_q, jnp.min)
            kp_hi = blocks(self.key_pos, block_k, jnp.max)
            out &= Q(qp_lo) - K(kp_hi) < self.window
        return out


def check_shapes(kernel: str, q_shape, kv_len: int, kv_heads: int, mask: AttentionMask) -> None:
    """Raises ValueError naming `kernel` unless q [B, Lq, H, hd], keys of length `kv_len`
    with `kv_heads` heads and `mask` (B, Lq, kv_len) fit together: the mask's shape, and
    H a multiple of the kv heads (grouped-query attention)."""
    B, Lq, H = q_shape[:3]
    if mask.shape != (B, Lq, kv_len):
        raise ValueError(
            f"{kernel}: mask shape {mask.shape} does not match q {tuple(q_shape)} and "
            f"{kv_len} keys (expected {(B, Lq, kv_len)})"
        )
    if H % kv_heads:
        raise ValueError(f"{kernel}: {H} query heads are not a multiple of {kv_heads} kv heads")


def visible(mask: AttentionMask, qi, ki, qs, ks, ke, qp, kp) -> jax.Array:
    """The may-attend rule of `mask` on broadcastable index / segment / end /
    position arrays (`dense` and the blocked kernels' tiles share it)."""
    seg = (qs > 0) & (ks > 0) if mask.tree else (qs == ks) & (qs > 0)
    out = (qi == ki) | ((ki <= qi) & (qi <= ke) & seg)
    if mask.window is not None:
        out &= qp - kp < mask.window
    return out


def _window(window: int | None) -> int | None:
    if window is None:
        return None
    if int(window) <= 0:
        raise ValueError(f"AttentionMask: window must be None or > 0, got {window}")
    return int(window)
