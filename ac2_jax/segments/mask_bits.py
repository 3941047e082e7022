"""Packed bit masks over a vocabulary (host numpy): one allowed set per row.

Token v is allowed iff bit v % 32 of word v // 32 is set (little-endian):
W = ceil(V / 32) uint32 words a mask, 18.5 KiB at V = 151,936 (a bool row:
148 KiB). `MaskTable` stores distinct masks once and numbers them 1..; the
learner unpacks rows in jax (`ac2_jax.losses.unpack_masks`).
"""

from __future__ import annotations

import numpy as np


def mask_words(vocab_size: int) -> int:
    """Words of one packed mask over `vocab_size` tokens: ceil(V / 32)."""
    return -(-int(vocab_size) // 32)


def pack_mask_bits(masks: np.ndarray) -> np.ndarray:
    """bool [..., V] allowed sets -> uint32 [..., ceil(V / 32)] bits (token v: bit
    v % 32 of word v // 32; bits past V are 0)."""
    m = np.asarray(masks)
    if m.dtype != np.bool_:
        raise ValueError(f"pack_mask_bits: masks must be bool [..., V], got dtype {m.dtype}")
    V = m.shape[-1]
    pad = mask_words(V) * 32 - V
    if pad:
        m = np.concatenate([m, np.zeros((*m.shape[:-1], pad), np.bool_)], axis=-1)
    packed = np.packbits(m, axis=-1, bitorder="little")  # uint8 [..., 4 W]
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32)


def unpack_mask_bits(words: np.ndarray, vocab_size: int) -> np.ndarray:
    """uint32 [..., W] -> bool [..., vocab_size] (host; `losses.unpack_masks` in jax).
    Tokens past the table's 32 W bits are not allowed."""
    w = np.ascontiguousarray(np.asarray(words, np.uint32)).astype("<u4")
    bits = np.unpackbits(w.view(np.uint8), axis=-1, bitorder="little").astype(np.bool_)
    V = int(vocab_size)
    if bits.shape[-1] < V:
        bits = np.concatenate([bits, np.zeros((*bits.shape[:-1], V - bits.shape[-1]), bool)], -1)
    return bits[..., :V]


class MaskTable:
    """A growing table of distinct packed masks; `add` returns 1-based ids."""

    def __init__(self, words: int | None = None):
        self.words = words
        self._rows: list[np.ndarray] = []
        self._index: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, packed: np.ndarray, who: str = "MaskTable") -> np.ndarray:
        """uint32 [n, W] packed masks -> int32 [n] ids (1..), equal masks one id."""
        packed = np.asarray(packed, np.uint32)
        if packed.ndim != 2:
            raise ValueError(f"{who}: packed masks must be uint32 [n, W], got shape {packed.shape}")
        if self.words is None:
            self.words = packed.shape[1]
        if packed.shape[1] != self.words:
            raise ValueError(
                f"{who}: masks of {packed.shape[1]} words ({packed.shape[1] * 32} tokens) "
                f"meet masks of {self.words} words in one batch; every constrained "
                "completion must be masked over the same vocabulary"
            )
        ids = np.empty(len(packed), np.int32)
        for i, row in enumerate(packed):
            key = row.tobytes()
            k = self._index.get(key)
            if k is None:
                self._rows.append(row.copy())
                k = self._index[key] = len(self._rows)
            ids[i] = k
        return ids

    def table(self, capacity: int | None = None) -> np.ndarray:
        """uint32 [capacity or len, W]: the masks, then all-zero rows (never referenced)."""
        n = len(self._rows) if capacity is None else int(capacity)
        if n < len(self._rows):
            raise ValueError(f"MaskTable: capacity {n} < {len(self._rows)} masks")
        out = np.zeros((n, self.words or 0), np.uint32)
        if self._rows:
            out[: len(self._rows)] = np.stack(self._rows)
        return out
