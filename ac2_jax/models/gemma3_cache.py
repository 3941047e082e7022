"""Gemma 3's KV cache: a ring of `sliding_window` slots for the sliding layers, the
full length for the global ones (`models.gemma3.Gemma3.init_cache` / `decode`).

`HybridCache` holds two `decoder.KVCache`s, each in the model's layout
(per-layer tuples [B, K, S, hd], or stacked [B, S, n, K * hd] over that kind's
layers, in layer order): `sliding`, the sliding layers' (with the model's
window: past `sliding_window` positions a ring of W slots per row, position p
in slot p mod W, as Mistral's `KVCache.ring`), and `full`, the full-attention
layers' (max_len slots). Either is None when no layer is of its kind. So a
sliding layer's KV memory stays at its window however long the sequence grows;
only the full layers' grows with it.

`run_cached` runs the layers against it. Per-layer: each layer reads and
writes its kind's cache. Stacked: one scan over all layers in order (the
kinds interleave), each layer taking its kind's branch (`lax.cond` on its
flag: the ring and the full cache differ in shape) and reading its kind's
stacked cache at its rank among that kind; the new keys / values come back
from the scan and are written once per kind. Each kind has its own mask and
write slots: the ring's from `decoder._ring_mask` (a chunk longer than the
window attends over the ring as it was plus its own keys), the full cache's
from `AttentionMask.decode`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ac2_jax.models.decoder import KVCache, _ring_mask
from ac2_jax.models.kernels.attention_mask import AttentionMask

__all__ = ["HybridCache", "check_cache", "init_hybrid_cache", "run_cached"]


@struct.dataclass
class HybridCache:
    """The sliding layers' cache (a ring past the window) and the full layers' cache."""

    sliding: KVCache | None
    full: KVCache | None

    @property
    def parts(self) -> tuple[KVCache, ...]:
        return tuple(p for p in (self.sliding, self.full) if p is not None)

    @property
    def stacked(self) -> bool:
        return self.parts[0].stacked

    @property
    def batch(self) -> int:
        return self.parts[0].batch

    @property
    def max_len(self) -> int:
        """Positions a row may take (0..max_len-1)."""
        return self.parts[0].max_len

    @property
    def num_layers(self) -> int:
        return sum(p.num_layers for p in self.parts)

    @property
    def window(self) -> int | None:
        """The sliding layers' window (None: no sliding layer, or no window)."""
        return None if self.sliding is None else self.sliding.window

    @property
    def ring(self) -> bool:
        """Whether the sliding layers' cache is a ring (max_len > window)."""
        return self.sliding is not None and self.sliding.ring


def init_hybrid_cache(c: Any, batch: int, max_len: int, dtype) -> HybridCache:
    """An empty cache of a `Gemma3Config` for `batch` rows of up to `max_len` positions."""
    n_sliding = sum(c.sliding)

    def part(n: int, window: int | None) -> KVCache | None:
        if n == 0:
            return None
        meta = {} if window is None else {"window": window, "length": max_len}
        S = KVCache.slots_for(max_len, window)  # a ring of W slots when max_len > W
        if c.scan_layers:
            shape = (batch, S, n, c.num_kv_heads * c.head_dim)
            return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), **meta)
        shape = (batch, c.num_kv_heads, S, c.head_dim)
        zeros = tuple(jnp.zeros(shape, dtype) for _ in range(n))
        return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(n)), **meta)

    return HybridCache(
        sliding=part(n_sliding, c.sliding_window), full=part(c.num_layers - n_sliding, None)
    )


def check_cache(c: Any, cache: Any, batch: int) -> None:
    """Raises ValueError unless `cache` is this config's `HybridCache` for `batch` rows."""
    if not isinstance(cache, HybridCache):
        raise ValueError(
            f"decode: Gemma3 takes a HybridCache (sliding and full layers' caches), got "
            f"{type(cache).__name__}; build it with model.init_cache"
        )
    n_sliding = sum(c.sliding)
    counts = [(cache.sliding, n_sliding), (cache.full, c.num_layers - n_sliding)]
    layout = lambda stacked: "stacked" if stacked else "per-layer"  # noqa: E731
    if any((p.num_layers if p is not None else 0) != n for p, n in counts) or any(
        p.stacked != c.scan_layers for p in cache.parts
    ):
        raise ValueError(
            f"decode: cache is {layout(cache.stacked)} with {cache.num_layers} layers "
            f"({n_sliding} sliding wanted), the model wants {layout(c.scan_layers)} with "
            f"{c.num_layers}; build it with model.init_cache"
        )
    if cache.batch != batch:
        raise ValueError(f"decode: cache batch {cache.batch} != tokens batch {batch}")
    if cache.full is not None and cache.full.window is not None:
        raise ValueError("decode: the full layers' cache has a window; build it with init_cache")
    if cache.sliding is not None and cache.sliding.window != c.sliding_window:
        raise ValueError(
            f"decode: cache window {cache.sliding.window} != the model's sliding_window "
            f"{c.sliding_window}; build it with model.init_cache"
        )


def _mask_and_slots(part: KVCache, positions: jax.Array, backend: str):
    """(mask, write slots [B, T], append) of new tokens at positions [B, T] against `part`."""
    if part.ring:
        assert part.window is not None  # a ring has one
        mask, slots, append = _ring_mask(positions, part.slots, part.window)
    else:
        S = part.max_len
        mask = AttentionMask.decode(positions, S, part.window)
        slots, append = jnp.where(positions >= 0, positions, S), False  # S: dropped
    return (mask.dense() if backend == "dense" else mask), slots, append


def run_cached(
    layer: Callable, c: Any, params: dict, x: jax.Array, ropes, positions, cache, backend: str
) -> tuple[jax.Array, HybridCache]:
    """x [B, T, D] through every layer against `cache` (a checked `HybridCache`).

    layer(w, x, rope, mask, kv) -> (x, kv): one layer with `layers.attention_apply`'s
    cache contract; params: the layers' params (stacked, or {i: layer i}); ropes:
    the (local, global) RoPE tables; positions [B, T] int32 (-1: padding).
    Returns (x, the new cache)."""
    flags = c.sliding
    seen = {True: 0, False: 0}
    rank = []  # each layer's index among the layers of its kind
    for f in flags:
        rank.append(seen[f])
        seen[f] += 1
    kinds = {True: (cache.sliding, ropes[0]), False: (cache.full, ropes[1])}
    run = {
        f: (part, rope, *_mask_and_slots(part, positions, backend))
        for f, (part, rope) in kinds.items()
        if part is not None
    }
    if not cache.stacked:
        ks = {f: list(r[0].k) for f, r in run.items()}
        vs = {f: list(r[0].v) for f, r in run.items()}
        for i, f in enumerate(flags):
            _, rope, mask, slots, append = run[f]
            j = rank[i]
            x, (ks[f][j], vs[f][j], *_) = layer(
                params[i], x, rope, mask, (ks[f][j], vs[f][j], None, slots, append)
            )
        new = {f: r[0].replace(k=tuple(ks[f]), v=tuple(vs[f])) for f, r in run.items()}
        return x, HybridCache(sliding=new.get(True), full=new.get(False))

    def branch(f: bool):
        part, rope, mask, slots, append = run[f]

        def apply(w, x, j):
            x, (k_new, v_new, *_) = layer(w, x, rope, mask, (part.k, part.v, j, slots, append))
            return x, (k_new, v_new)

        return apply

    def body(x, xs):
        w, flag, j = xs
        if len(run) == 1:
            return branch(next(iter(run)))(w, x, j)
        return jax.lax.cond(flag, branch(True), branch(False), w, x, j)

    xs = (params, jnp.asarray(flags), jnp.asarray(rank, jnp.int32))
    x, (k_new, v_new) = jax.lax.scan(body, x, xs)  # [layers, B, T, F], in layer order
    rows = jnp.arange(x.shape[0])[None, :, None]
    new = {}
    for f, (part, _, _, slots, _) in run.items():
        idx = np.flatnonzero(np.asarray(flags) == f)
        at = (rows, slots[None], jnp.arange(len(idx))[:, None, None])
        assert not isinstance(part.k, tuple) and not isinstance(part.v, tuple)
        new[f] = part.replace(
            k=part.k.at[at].set(k_new[idx], mode="drop"),
            v=part.v.at[at].set(v_new[idx], mode="drop"),
        )
    return x, HybridCache(sliding=new.get(True), full=new.get(False))
