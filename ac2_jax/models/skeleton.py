"""The transformer skeleton every family runs on: `Transformer` (Flax NNX).

It owns what every decoder-only family shares: the token embedding (with the
family's scale), the layers run in a Python loop (per-layer params,
`layers.{i}`) or in runs under `jax.lax.scan` (stacked params [n, ...]), remat,
the final norm, the head (tied or not) and its fp32 logits, an adapter bank's
rows (`adapter_ids`), the KV cache (`init_cache`, its checks, the sliding
window's ring and mask, the write-back) and the decode step (`decode`).

A family supplies (class attributes and a few methods; see `Decoder`,
`MoEDecoder`, `Gemma3`):

* `build_layer(config, rngs, stack, count)`: the params of its block (one
  layer, or `count` of them stacked) for each of its param stacks (`STACKS`:
  `layers`, and e.g. MoE's `dense_layers`), and `layer_stack(i)`: which stack
  layer i's params are in;
* `block(stack, w, x, rope, mask, run, cache, inputs) -> (x, cache, out)`: one
  layer's math on its params `w` (a pure dict): x [B, L, D] in the compute
  dtype; rope its kind's `rope_cos_sin` tables (cos, sin), fp32
  [B, L, 1, head_dim]; mask its kind's `AttentionMask`, or a dense bool
  [B, Lq, Lk] when the backend is "dense"; cache None (training) or
  `models.layers.attention_apply`'s tuple (k, v, layer index or None, write
  slots [B, L], append); `run` the forward's `Run`; an optional per-layer
  input `inputs` (MoE's replayed routing, this layer's slice of
  `layer_inputs`) and output `out` (MoE's routing stats, stacked per stack in
  layer order);
* `NORM`: its norm module (the final norm); `embed_scale()`: what the
  embeddings are multiplied by (None: nothing);
* `attention_kinds()`: one `AttentionKind` (window, RoPE inverse frequencies)
  per kind of layer (one, or two: Gemma 3's sliding / full), and
  `layer_kind(i)`; each kind has its own mask, RoPE tables and part of the
  cache (`cache_from_parts` / `cache_parts` wrap them: `KVCache` for one kind,
  Gemma 3's `HybridCache` for two).

Layers: with `config.scan_layers` each stack's params are [n, ...] and the
layers run as consecutive runs of one stack, each run under `jax.lax.scan`
(a layer's kind, its rank in its kind's cache and its inputs are scanned
beside its params); else a list (`layers.{i}`) run in a Python loop. The math
is the same either way. `config.remat` picks what the backward pass
recomputes per layer.

KV cache: slot p of row b holds the keys and values of that row's token at
position p; a query at position q attends to slots 0..q (and within its
kind's window). Every slot a query can see was written by the row's own
prefill / steps before it is read, so stale slots of an earlier request never
leak and rows need no length bookkeeping. Padding tokens take position -1:
they write nothing and their logits are meaningless. A windowed kind's cache
for more positions than its window is a ring of `window` slots (`KVCache.ring`,
`_ring_mask`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from ac2_jax.losses import LMHead
from ac2_jax.models.config import ModelConfig, resolve_config
from ac2_jax.models.kernels.attention import choose_backend
from ac2_jax.models.kernels.attention_mask import BIG, AttentionMask
from ac2_jax.models.layers import RMSNorm, _param, layer_params, rope_cos_sin
from ac2_jax.models.lora import LoRAScale

__all__ = ["AttentionKind", "HybridCache", "KVCache", "Run", "Transformer"]

_POLICIES = {"full": None, "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


@struct.dataclass
class KVCache:
    """Keys and values of every layer (of one kind). Slot p of row b holds the keys /
    values of that row's token at position p; every leaf is [batch, ...] with `slots`
    slots on `seq_axis`.

    Per-layer models: k, v are tuples of num_layers arrays [B, K, S, hd]
    (heads-major: a decode step's attention reads them without a transposed
    copy). Scanned models: k, v are single arrays [B, S, num_layers, K * hd],
    carried through the layer scan. `seq_axis` is the slot axis of every leaf.

    Sliding window (static `window`, the model's): a cache for `max_len`
    positions (static `length`) longer than the window is a ring of `window`
    slots, position p in slot p mod window (`ring`), so its memory stays at the
    window however long the sequence grows; a query sees exactly the last
    `window` positions, which the ring still holds.
    """

    k: tuple | jax.Array
    v: tuple | jax.Array
    window: int | None = struct.field(pytree_node=False, default=None)
    length: int | None = struct.field(pytree_node=False, default=None)

    @property
    def stacked(self) -> bool:
        return not isinstance(self.k, tuple)

    @property
    def batch(self) -> int:
        return jax.tree.leaves(self.k)[0].shape[0]

    @property
    def seq_axis(self) -> int:
        return 1 if self.stacked else 2

    @property
    def slots(self) -> int:
        """Slots held per row (the window for a ring)."""
        return jax.tree.leaves(self.k)[0].shape[self.seq_axis]

    @property
    def max_len(self) -> int:
        """Positions a row may take (0..max_len-1)."""
        return self.slots if self.length is None else self.length

    @property
    def ring(self) -> bool:
        return self.window is not None and self.window < self.max_len

    @staticmethod
    def slots_for(max_len: int, window: int | None) -> int:
        """Slots of a cache for `max_len` positions under `window`."""
        return max_len if window is None else min(max_len, window)

    @property
    def num_layers(self) -> int:
        k = self.k
        return len(k) if isinstance(k, tuple) else k.shape[2]


@struct.dataclass
class HybridCache:
    """Two kinds of layers' caches (Gemma 3): the sliding layers' (`sliding`, a ring
    of `window` slots past the window) and the full layers' (`full`, max_len slots),
    each a `KVCache` in the model's layout over that kind's layers in layer order;
    either is None when no layer is of its kind."""

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


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    """One kind of layer's attention: its sliding `window` (None: causal over the whole
    segment) and its RoPE inverse frequencies [head_dim // 2]."""

    window: int | None
    inv_freq: np.ndarray


@dataclasses.dataclass(frozen=True)
class Run:
    """What every layer of one forward shares: the attention kernel that runs, an
    adapter bank's (slot ids [B], scale [B]) or None, and which tokens are real [B, L]
    (False: padding)."""

    backend: str
    lora: tuple | None
    real: jax.Array


class Transformer(nnx.Module):
    """Embeddings, the family's layers, final norm, head (see the module doc).

    With `tie_embeddings` the head is the embedding matrix. Built from any config of
    its family: `__init__` resolves it (`models.config.resolve_config`: the family
    registry's checks, scan_layers / remat "auto" by the memory plan), so `config`
    here is the resolved one, and models built from a config and from its resolved
    copy have equal graph definitions (one jit cache entry).
    """

    config: Any
    layers: Any  # nnx.List of blocks, or the stacked block
    norm: nnx.Module
    lm_head: nnx.Param
    lora_scale: LoRAScale
    NORM: ClassVar[type] = RMSNorm
    STACKS: ClassVar[tuple[str, ...]] = ("layers",)  # the param stacks under scan_layers

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs | None = None):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        # The one place a model's config is resolved (family registry, LoRA targets,
        # the memory plan's scan_layers / remat): `self.config` never holds "auto".
        c = self.config = resolve_config(config)
        init = nnx.initializers.normal(c.initializer_range)
        shape = (c.vocab_size, c.hidden_size)
        self.embed_tokens = _param(rngs, init, shape, c.base_dtype, ("vocab", "embed"))
        for i in range(c.num_layers):
            if self.layer_stack(i) not in self.STACKS:
                raise ValueError(
                    f"{type(self).__name__}.layer_stack({i}) is {self.layer_stack(i)!r}, not one "
                    f"of its STACKS {tuple(self.STACKS)}"
                )
        if c.scan_layers:
            for name in self.STACKS:
                n = sum(self.layer_stack(i) == name for i in range(c.num_layers))
                setattr(self, name, self.build_layer(c, rngs, name, n) if n else None)
        else:
            blocks = [self.build_layer(c, rngs, self.layer_stack(i)) for i in range(c.num_layers)]
            self.layers = nnx.List(blocks)
            for name in self.STACKS[1:]:
                setattr(self, name, None)
        self.norm = self.NORM(c.hidden_size, c.rms_eps, c.dtype, c.base_dtype)
        if not c.tie_embeddings:
            shape = (c.hidden_size, c.vocab_size)
            self.lm_head = _param(rngs, init, shape, c.base_dtype, ("embed", "vocab"))
        if c.lora is not None and c.lora.slots is not None:  # a bank: each slot's scale
            self.lora_scale = LoRAScale(jnp.zeros((c.lora.slots,), jnp.float32))

    @property
    def param_stacks(self) -> tuple[str, ...]:
        """The attributes holding the layers' params: `STACKS` (stacked), or `layers`
        (the per-layer list)."""
        return tuple(self.STACKS) if self.config.scan_layers else ("layers",)

    # -- what a family supplies

    def build_layer(
        self, config: Any, rngs: nnx.Rngs, stack: str, count: int | None = None
    ) -> nnx.Module:
        """The params of one layer of param stack `stack` (`count` of them stacked)."""
        raise NotImplementedError

    def layer_stack(self, i: int) -> str:
        """The param stack (`STACKS`) holding layer i's params."""
        return "layers"

    def block(self, stack: str, w: dict, x, rope, mask, run: Run, cache=None, inputs=None):
        """One layer of stack `stack` on its params `w` (a pure dict): returns (x, cache,
        out). x [B, L, D] in the compute dtype (returned likewise); rope: the layer's
        kind's `rope_cos_sin` tables (cos, sin), fp32 [B, L, 1, head_dim]; mask: its
        `AttentionMask`, or a dense bool [B, Lq, Lk] for the "dense" backend; cache:
        None, or (k, v, layer | None, slots [B, L], append), as `attention_apply`
        (`models.layers`) takes it, returned updated; inputs: this layer's slice of
        `layer_inputs` (None if none); out: a per-layer output pytree (e.g. MoE's
        routing stats) or None."""
        raise NotImplementedError

    def embed_scale(self) -> float | None:
        """What the embeddings are multiplied by (in the embedding's dtype); None: 1."""
        return None

    def attention_kinds(self) -> tuple[AttentionKind, ...]:
        """The kinds of layer attention (one or two), each its window and RoPE. With two,
        only kind 0 may have a window (under the layer scan a blocked kernel runs every
        layer on kind 0's mask structure, kind 1's being it without the window)."""
        raise NotImplementedError

    def layer_kind(self, i: int) -> int:
        """Layer i's attention kind (an index into `attention_kinds()`)."""
        return 0

    def cache_from_parts(self, parts: tuple[KVCache | None, ...]) -> Any:
        """The cache of each kind's part (None: no layer of that kind)."""
        return parts[0]

    def cache_parts(self, cache: Any) -> tuple[KVCache | None, ...]:
        """Each kind's part of a cache (`cache_from_parts`'s inverse)."""
        if not isinstance(cache, KVCache):
            raise ValueError(
                f"decode: {type(self).__name__} takes a KVCache, got {type(cache).__name__}; "
                "build it with model.init_cache"
            )
        return (cache,)

    # -- shared pieces

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, L] int -> [B, L, D] in the compute dtype (times `embed_scale()`,
        rounded to the embedding's dtype first, as HF does)."""
        table = self.embed_tokens[...]
        x = jnp.take(table, tokens, axis=0)
        scale = self.embed_scale()
        if scale is not None:
            x = x * jnp.asarray(scale, jnp.float32).astype(table.dtype)
        return x.astype(self.config.dtype)

    def head(self) -> LMHead:
        """The output projection: the embedding [V, D] when tied, else lm_head [D, V]."""
        if self.config.tie_embeddings:
            return LMHead(self.embed_tokens[...], "vd")
        return LMHead(self.lm_head[...], "dv")

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final hidden states [..., D] (already normed, compute dtype) -> fp32 logits
        [..., V] (`head().logits`: the weight in the hidden states' dtype, fp32 sums)."""
        return self.head().logits(hidden)

    def _kinds(self) -> tuple[tuple[AttentionKind, ...], np.ndarray]:
        """(the attention kinds, each layer's kind [num_layers])."""
        kinds = self.attention_kinds()
        if not 1 <= len(kinds) <= 2 or (len(kinds) == 2 and kinds[1].window is not None):
            raise ValueError(
                f"{type(self).__name__}.attention_kinds(): the skeleton runs one or two kinds, "
                f"only the first with a window; got windows {[k.window for k in kinds]} "
                "(put the windowed kind first)"
            )
        of = [self.layer_kind(i) for i in range(self.config.num_layers)]
        for i, k in enumerate(of):
            if k not in range(len(kinds)):
                raise ValueError(
                    f"{type(self).__name__}.layer_kind({i}) is {k!r}; attention_kinds() "
                    f"has {len(kinds)} kind(s), so it must be in 0..{len(kinds) - 1}"
                )
        return kinds, np.asarray(of)

    def _backend(self, kind: str, q_len: int) -> str:
        """The attention kernel; a sliding window runs on those that take any mask."""
        c = self.config
        backend = choose_backend(
            c.attention_backend,
            kind=kind,
            q_len=q_len,
            dtype=c.dtype,
            head_dim=c.head_dim,
            block=c.attention_block,
        )
        kinds, of = self._kinds()
        windowed = any(kinds[k].window is not None for k in set(of.tolist()))
        if windowed and backend in ("pallas_gpu", "splash_tpu", "pallas_tpu"):
            return "dense"  # they take no window
        return backend

    def _ropes(self, positions: jax.Array) -> list:
        """Each kind's `rope_cos_sin` tables of positions [B, L]."""
        return [rope_cos_sin(positions, jnp.asarray(k.inv_freq)) for k in self._kinds()[0]]

    def _lora_rows(self, adapter_ids: jax.Array | None, batch: int):
        """(slot ids [B], scale [B]) of an adapter bank's rows (None: every row slot 0,
        the base model); None for a model without a bank."""
        c = self.config
        if c.lora is None or c.lora.slots is None:
            if adapter_ids is not None:
                raise ValueError(
                    f"{type(self).__name__}: adapter_ids given, but the model has no adapter "
                    f"bank ({type(c).__name__}.lora.slots)"
                )
            return None
        _check_rows(type(self).__name__, batch, adapter_ids=adapter_ids)
        ids = jnp.zeros((batch,), jnp.int32) if adapter_ids is None else adapter_ids
        ids = ids.astype(jnp.int32)
        return ids, jnp.take(self.lora_scale[...], ids, axis=0)

    def _runs(self) -> list[tuple[str, int, int, int]]:
        """(stack, first layer, layers, offset in its stack) of each run of consecutive
        layers of one param stack, in layer order."""
        runs, seen = [], dict.fromkeys(self.STACKS, 0)
        for stack, group in itertools.groupby(range(self.config.num_layers), self.layer_stack):
            layers = list(group)
            runs.append((stack, layers[0], len(layers), seen[stack]))
            seen[stack] += len(layers)
        return runs

    def _apply_layers(self, x, layer, kinds: np.ndarray, ranks: np.ndarray, inputs: dict):
        """Runs every layer: layer(stack, w, x, kind, rank, inputs_i) -> (x, (kv, out)),
        kind / rank Python ints (per-layer) or traced int32 scalars (under scan: scanned
        beside the params); inputs: per stack,
        a pytree with that stack's layers on its leading axis. Returns (x, kvs in layer
        order: a list (per-layer) or arrays [num_layers, ...] (stacked), {stack: outs
        stacked in its layer order})."""
        c = self.config
        kvs: list = []
        outs: dict[str, list] = {}
        if not c.scan_layers:
            params = layer_params(c, self.layers)
            rank_in_stack = dict.fromkeys(self.STACKS, 0)
            for i in range(c.num_layers):
                stack = self.layer_stack(i)
                j = rank_in_stack[stack]
                rank_in_stack[stack] += 1
                inp = inputs.get(stack)
                inp = None if inp is None else jax.tree.map(lambda a, j=j: a[j], inp)
                x, (kv, out) = layer(stack, params[i], x, int(kinds[i]), int(ranks[i]), inp)
                kvs.append(kv)
                if out is not None:
                    outs.setdefault(stack, []).append(out)
            return x, kvs, {s: jax.tree.map(lambda *a: jnp.stack(a), *o) for s, o in outs.items()}
        stacks = {
            s: layer_params(c, getattr(self, s))
            for s in self.STACKS
            if getattr(self, s) is not None
        }
        for stack, first, n, off in self._runs():
            w = stacks[stack]
            if n != jax.tree.leaves(w)[0].shape[0]:
                w = jax.tree.map(lambda a, off=off, n=n: a[off : off + n], w)
            inp = inputs.get(stack)
            if inp is not None:
                inp = jax.tree.map(lambda a, off=off, n=n: a[off : off + n], inp)
            xs = (
                w,
                jnp.asarray(kinds[first : first + n], jnp.int32),
                jnp.asarray(ranks[first : first + n]),
                inp,
            )
            fn = functools.partial(layer, stack)
            x, (kv, out) = jax.lax.scan(lambda x, xs, fn=fn: fn(xs[0], x, *xs[1:]), x, xs)  # type: ignore[misc]
            kvs.append(kv)
            if out is not None:
                outs.setdefault(stack, []).append(out)
        kv_all = None if kvs[0] is None else jax.tree.map(_concat, *kvs)
        return (
            x,
            kv_all,
            {s: jax.tree.map(_concat, *o) for s, o in outs.items()},
        )

    # -- training / scoring

    def layer_inputs(self, shape: tuple[int, ...], **inputs: Any) -> dict:
        """{stack: per-layer inputs [n, ...]} (`block`'s `inputs`) from the keyword
        inputs of a forward of tokens of `shape` (MoE: `routing`); none by default."""
        if inputs:
            raise TypeError(
                f"{type(self).__name__}: unexpected keyword argument(s) {sorted(inputs)} "
                "(this family takes no per-layer inputs)"
            )
        return {}

    def forward(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        subtree_end: jax.Array | None = None,
        adapter_ids: jax.Array | None = None,
        **inputs: Any,
    ) -> tuple[jax.Array, dict]:
        """(final normed hidden states [B, L, D], {stack: its layers' outputs stacked})
        of packed rows.

        tokens, positions (restart at 0 per segment: a window counts from the
        segment's start), segment_ids (1.. per row, 0 = padding), subtree_end
        (tree packing only): [B, L] int; adapter_ids [B] int: each row's slot of
        an adapter bank (`models.lora`); inputs: the family's (`layer_inputs`).
        """
        _check_2d(
            type(self).__name__,
            tokens=tokens,
            positions=positions,
            segment_ids=segment_ids,
            subtree_end=subtree_end,
        )
        c = self.config
        lora = self._lora_rows(adapter_ids, tokens.shape[0])
        backend = self._backend("flat" if subtree_end is None else "tree", tokens.shape[1])
        kinds, of = self._kinds()
        structures: dict[int | None, AttentionMask] = {}
        for k in kinds:  # one mask per window
            if k.window not in structures:
                structures[k.window] = AttentionMask.packed(
                    segment_ids, subtree_end, positions=positions, window=k.window
                )
        dense = {w: m.dense() for w, m in structures.items()} if backend == "dense" else structures
        masks = [dense[k.window] for k in kinds]
        ropes = self._ropes(positions)  # once for all layers
        run = Run(backend, lora, segment_ids > 0)

        def layer(stack, w, x, rope, mask, inp):
            x, _, out = self.block(stack, w, x, rope, mask, run, None, inp)
            return x, out

        if c.remat != "none":
            layer = jax.checkpoint(
                layer,
                policy=_POLICIES[str(c.remat)],
                prevent_cse=not c.scan_layers,
                static_argnums=(0,),
            )

        def step(stack, w, x, kind, rank, inp):
            x, out = layer(stack, w, x, _pick(kind, ropes), _pick(kind, masks), inp)
            return x, (None, out)

        inp = self.layer_inputs(tokens.shape, **inputs)
        x, _, outs = self._apply_layers(self.embed(tokens), step, of, of * 0, inp)
        return self.norm(x), outs

    def hidden_states(
        self, tokens, positions, segment_ids, subtree_end=None, adapter_ids=None, **inputs
    ) -> jax.Array:
        """Final normed hidden states [B, L, D] of packed rows (`forward`'s arguments)."""
        return self.forward(tokens, positions, segment_ids, subtree_end, adapter_ids, **inputs)[0]

    def __call__(
        self, tokens, positions, segment_ids, subtree_end=None, adapter_ids=None, **inputs
    ) -> jax.Array:
        """fp32 logits [B, L, V] of packed rows (`forward`'s arguments); logits[b, p]
        predicts the token after p."""
        return self.logits(
            self.hidden_states(tokens, positions, segment_ids, subtree_end, adapter_ids, **inputs)
        )

    # -- sampling with a KV cache

    def init_cache(self, batch: int, max_len: int, dtype=None) -> Any:
        """An empty cache for `batch` rows of up to `max_len` positions each: per kind of
        layer a `KVCache`, a ring of `window` slots when max_len is longer.

        dtype defaults to the compute dtype. The cache is a pytree; pass it
        through `jax.jit` and donate it to update in place.
        """
        c = self.config
        dt = c.dtype if dtype is None else dtype
        kinds, of = self._kinds()

        def part(n: int, window: int | None) -> KVCache | None:
            if n == 0:
                return None
            meta = {} if window is None else {"window": window, "length": max_len}
            S = KVCache.slots_for(max_len, window)  # a ring of W slots when max_len > W
            if c.scan_layers:
                shape = (batch, S, n, c.num_kv_heads * c.head_dim)
                return KVCache(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt), **meta)
            shape = (batch, c.num_kv_heads, S, c.head_dim)
            return KVCache(
                k=tuple(jnp.zeros(shape, dt) for _ in range(n)),
                v=tuple(jnp.zeros(shape, dt) for _ in range(n)),
                **meta,
            )

        parts = tuple(part(int(np.sum(of == j)), k.window) for j, k in enumerate(kinds))
        return self.cache_from_parts(parts)

    def _check_cache(self, cache: Any, batch: int) -> tuple[KVCache | None, ...]:
        """Each kind's part of `cache`, checked against this model (ValueError)."""
        c = self.config
        parts = self.cache_parts(cache)
        kinds, of = self._kinds()
        wanted = [int(np.sum(of == j)) for j in range(len(kinds))]
        have = [0 if p is None else p.num_layers for p in parts]
        real = [p for p in parts if p is not None]
        if have != wanted or any(p.stacked != c.scan_layers for p in real):
            layout = lambda stacked: "stacked" if stacked else "per-layer"  # noqa: E731
            per_kind = f" ({have} per kind, {wanted} wanted)" if len(kinds) > 1 else ""
            raise ValueError(
                f"decode: cache is {layout(real[0].stacked)} with {sum(have)} layers"
                f"{per_kind}, the model wants {layout(c.scan_layers)} with {c.num_layers}; "
                "build it with model.init_cache"
            )
        if real[0].batch != batch:
            raise ValueError(f"decode: cache batch {real[0].batch} != tokens batch {batch}")
        for p, k in zip(parts, kinds, strict=True):
            if p is not None and p.window != k.window:
                raise ValueError(
                    f"decode: cache window {p.window} != the model's sliding_window "
                    f"{k.window}; build it with model.init_cache"
                )
        return parts

    def decode_with_outputs(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: Any,
        *,
        logits_at: jax.Array | None = None,
        adapter_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, Any, dict]:
        """Runs T new tokens per row against the cache: prefill (T > 1) or a step (T = 1).

        tokens [B, T] int; positions [B, T] int: the position of each token in
        its row's sequence (0 for the first prompt token), which is also its
        cache slot. Use -1 for padding (left or right): padding writes nothing.
        Positions must be < cache.max_len: concrete positions past it are refused
        (ValueError); under `jit` they cannot be checked, so a jitted caller keeps
        them below (the sampler refuses a request past its `max_context`).
        Query (b, t) attends to slots 0..positions[b, t] of row b, which hold
        this call's tokens and everything the row wrote before (and on windowed
        layers only those within the window, which their ring holds; a chunk
        longer than the window attends over the ring as it was plus its own
        keys). A row can be reused for a new request by prefilling it from
        position 0 again.

        Returns (logits, new cache, {stack: its layers' outputs, e.g. MoE's
        routing}). logits is fp32 [B, T, V], or [B, V] when `logits_at` [B] int
        is given (the logits of token t = logits_at[b] of each row, e.g. the
        last prompt token after prefill). Shapes are static,
        so jit it once per (B, T); a step costs O(max_len) attention and O(1)
        everything else. adapter_ids [B] int: each row's slot of an adapter bank
        (`models.lora`; None: slot 0, the base model).
        """
        _check_2d(type(self).__name__, tokens=tokens, positions=positions)
        _check_rows(type(self).__name__, tokens.shape[0], logits_at=logits_at)
        c = self.config
        parts = self._check_cache(cache, tokens.shape[0])
        max_len = next(p.max_len for p in parts if p is not None)  # every part's
        _check_positions(type(self).__name__, positions, max_len)
        kinds, of = self._kinds()
        positions = positions.astype(jnp.int32)
        backend = self._backend("decode", tokens.shape[1])
        ranks = np.zeros_like(of)  # each layer's index among the layers of its kind
        for j in range(len(kinds)):
            ranks[of == j] = np.arange(int(np.sum(of == j)))
        ropes = self._ropes(jnp.maximum(positions, 0))  # once for all layers
        run = Run(backend, self._lora_rows(adapter_ids, tokens.shape[0]), positions >= 0)
        live = {j: (p, *_mask_and_slots(p, positions, backend)) for j, p in enumerate(parts) if p}

        def branch(stack, kind: int):
            part, mask, slots, append = live[kind]

            def apply(w, x, rank):
                if c.scan_layers:
                    kv = (part.k, part.v, rank, slots, append)
                else:
                    kv = (part.k[rank], part.v[rank], None, slots, append)
                x, kv, out = self.block(stack, w, x, ropes[kind], mask, run, kv)
                return x, (kv[:2], out)

            return apply

        def step(stack, w, x, kind, rank, inp):
            if isinstance(kind, int):
                return branch(stack, kind)(w, x, rank)
            if len(live) == 1:
                return branch(stack, next(iter(live)))(w, x, rank)
            return jax.lax.switch(kind, [branch(stack, j) for j in range(len(kinds))], w, x, rank)

        x, kvs, outs = self._apply_layers(self.embed(tokens), step, of, ranks, {})
        new: list[KVCache | None] = []
        for j, p in enumerate(parts):
            if p is None:
                new.append(None)
                continue
            idx = np.flatnonzero(of == j)
            _, _, slots, _ = live[j]
            k: tuple | jax.Array
            v: tuple | jax.Array
            if c.scan_layers:
                k_new, v_new = kvs
                if len(idx) != c.num_layers:
                    k_new, v_new = k_new[idx], v_new[idx]
                rows = jnp.arange(tokens.shape[0])[None, :, None]
                at = (rows, slots[None], jnp.arange(len(idx))[:, None, None])
                assert not isinstance(p.k, tuple) and not isinstance(p.v, tuple)  # a scan cache
                k = p.k.at[at].set(k_new, mode="drop")  # [layers, B, T, F] into [B, S, layers, F]
                v = p.v.at[at].set(v_new, mode="drop")
            else:
                k, v = tuple(kvs[i][0] for i in idx), tuple(kvs[i][1] for i in idx)
            new.append(KVCache(k=k, v=v, window=p.window, length=p.length))
        x = self.norm(x)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at.astype(jnp.int32)[:, None, None], axis=1)[:, 0]
        return self.logits(x), self.cache_from_parts(tuple(new)), outs

    def decode(
        self, tokens, positions, cache, *, logits_at=None, adapter_ids=None
    ) -> tuple[jax.Array, Any]:
        """(logits, new cache) of `decode_with_outputs` (same arguments)."""
        return self.decode_with_outputs(
            tokens, positions, cache, logits_at=logits_at, adapter_ids=adapter_ids
        )[:2]


def _pick(kind, per_kind: list):
    """The entry of `per_kind` (masks or RoPE tables, one per attention kind, at most
    two) of a layer of `kind`: a Python int (layers in a loop), or under scan a traced
    int32 scalar. Two AttentionMasks that differ only by a window are one structure: the
    windowed one with its positions zeroed (the window compares position differences)
    is the other, so blocked kernels keep one mask structure for every layer."""
    if isinstance(kind, int):
        return per_kind[kind]
    if len(per_kind) == 1 or per_kind[0] is per_kind[1]:
        return per_kind[-1]
    first, other = per_kind
    is_first = kind == 0
    if isinstance(first, AttentionMask):
        f = is_first.astype(jnp.int32)
        return dataclasses.replace(first, q_pos=first.query_pos * f, kv_pos=first.key_pos * f)
    return jax.tree.map(lambda s, a: jnp.where(is_first, s, a), first, other)


def _concat(*arrays: jax.Array) -> jax.Array:
    return jnp.concatenate(arrays)


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


def _ring_mask(positions: jax.Array, C: int, window: int) -> tuple[AttentionMask, jax.Array, bool]:
    """(mask, write slots, append) of T new tokens [B, T] against a ring of C slots.

    A row's positions are contiguous (its history 0..first-1, then this call's).
    One token (T = 1, a step) is written first, into slot p mod C, evicting
    position p - C, which is outside the window; slot s then holds position
    p - ((p - s) mod C). A chunk (T > 1) would evict keys its own earlier
    tokens still see, so it attends over the ring as it was (slot s holding
    first-1 - ((first-1 - s) mod C)) followed by its own keys (`append`), and
    then writes only its last C tokens (more would land on one slot twice).
    Slots of negative positions (never written by this row) are masked.
    """
    B, T = positions.shape
    real = positions >= 0
    s = jnp.arange(C, dtype=jnp.int32)[None]
    if T == 1:
        p = positions[:, :1]
        held = p - jnp.mod(p - s, C)
        kv = jnp.where((held >= 0) & (p >= 0), held, BIG)
        slots = jnp.where(real, jnp.mod(positions, C), C)
        append = False
    else:
        first = jnp.min(jnp.where(real, positions, BIG), axis=1, keepdims=True)
        last = jnp.max(positions, axis=1, keepdims=True)
        prev = first - 1
        held = prev - jnp.mod(prev - s, C)
        old = jnp.where((held >= 0) & (first < BIG), held, BIG)
        kv = jnp.concatenate([old, jnp.where(real, positions, BIG)], axis=1)
        slots = jnp.where(real & (positions > last - C), jnp.mod(positions, C), C)
        append = True
    ones = jnp.ones(kv.shape, jnp.int32)
    mask = AttentionMask(
        positions, kv, real.astype(jnp.int32), ones, jnp.full_like(ones, BIG), window=window
    )
    return mask, slots, append


def _check_positions(model: str, positions, max_len: int) -> None:
    """Raises ValueError naming `model` when concrete `positions` reach past a cache of
    `max_len` positions (a write there would land nowhere). Traced ones pass: under
    `jit` the caller keeps them in range."""
    if isinstance(positions, jax.core.Tracer) or not np.size(positions):
        return
    last = int(np.max(np.asarray(positions)))
    if last >= max_len:
        raise ValueError(
            f"{model}.decode: position {last} is past the cache, which holds positions "
            f"0..{max_len - 1}; build a longer one with model.init_cache(batch, max_len)"
        )


def _check_2d(model: str, **arrays):
    """Raises ValueError naming `model` and the array unless each is [batch, length]."""
    for name, a in arrays.items():
        if a is not None and getattr(a, "ndim", None) != 2:
            raise ValueError(
                f"{model}: {name} must be [batch, length], got shape {getattr(a, 'shape', None)}"
            )


def _check_rows(model: str, batch: int, **arrays):
    """Raises ValueError naming `model` and the array unless each (if given) is [batch]."""
    for name, a in arrays.items():
        if a is not None and tuple(getattr(a, "shape", ())) != (batch,):
            raise ValueError(
                f"{model}: {name} must be [batch] = [{batch}], got shape "
                f"{getattr(a, 'shape', None)}"
            )
