"""Decoder: a Qwen3 / Llama style transformer in Flax NNX.

Two ways to run it:

* Training / scoring (packed rows):
  `model(tokens, positions, segment_ids, subtree_end=None) -> logits [B, L, V]`
  (fp32). The attention mask is `ac2_jax.losses.attention_mask`, so packed
  segments never see each other and tree rows see only their ancestors.
  `hidden_states` gives the final normed hidden states [B, L, D] and
  `logits` projects any of them (for losses that chunk the vocabulary).

* Sampling with a KV cache (see `Decoder.decode`):
  `cache = model.init_cache(batch, max_len)`, then
  `logits, cache = model.decode(tokens, positions, cache)` for prefill
  (T > 1) and for each step (T = 1). Cache slot p of row b holds the keys and
  values of that row's token at position p; a query at position q attends to
  slots 0..q. Every slot a query can see was written by the row's own
  prefill/steps before it is read, so stale slots of an earlier request never
  leak and rows need no length bookkeeping. Padding tokens take position -1:
  they write nothing and their logits are meaningless.

Layers: with `config.scan_layers` their params are stacked [num_layers, ...]
(`layers.self_attn.q_proj`, ...) and run under `jax.lax.scan`, else they are
a list (`layers.0.self_attn.q_proj`, ...) run in a Python loop; the math is
the same (`models.layers`). `config.remat` picks what the backward pass
recomputes per layer. `models.stacking` converts between the two layouts;
HF and Orbax I/O accept either.

Compute runs in `config.dtype` (e.g. bfloat16) with weights stored in
`config.param_dtype` (e.g. float32 master weights) and cast at use; norms,
softmax and logits are fp32.

Parameters carry logical axis names (`models.axes`: "vocab", "embed",
"heads", "kv", "mlp", "layers"); `nnx.get_partition_spec(nnx.state(model))`
gives them, and one rules table (`AxisRules`) maps them to mesh axes. Params
are sharded at creation when a mesh is set (`jax.set_mesh`, Auto axis types),
by the active rules; with no mesh everything is plain arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from ac2_jax.losses import LMHead
from ac2_jax.models.config import DecoderConfig
from ac2_jax.models.kernels.attention import attention, choose_backend
from ac2_jax.models.kernels.attention_mask import BIG, AttentionMask
from ac2_jax.models.layers import (
    Block,
    RMSNorm,
    _param,
    apply_rope,
    block_apply,
    layer_params,
    rope_cos_sin,
    rope_inv_freq,
)
from ac2_jax.models.lora import LoRAScale

# attention, apply_rope and rope_inv_freq lived here before models.layers and
# models.kernels.attention.
__all__ = ["Decoder", "KVCache", "attention", "apply_rope", "rope_inv_freq"]

_POLICIES = {"full": None, "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


@struct.dataclass
class KVCache:
    """Keys and values of every layer. Slot p of row b holds the keys / values of that
    row's token at position p; every leaf is [batch, ...] with `slots` slots on `seq_axis`.

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


def embedding(c, rngs: nnx.Rngs) -> nnx.Param:
    """The token embedding [V, D] of a decoder of config `c` (its frozen-base dtype)."""
    init = nnx.initializers.normal(c.initializer_range)
    return _param(rngs, init, (c.vocab_size, c.hidden_size), c.base_dtype, ("vocab", "embed"))


def add_head(model: nnx.Module, c, rngs: nnx.Rngs, norm: nnx.Module) -> None:
    """Sets what follows the layers on `model`: the final `norm`, the lm_head [D, V]
    unless tied, and an adapter bank's per-slot scales (`models.lora`). Called after
    the layers are built, so the rng stream draws in the order the layers expect."""
    setattr(model, "norm", norm)  # noqa: B010 - any decoder class
    if not c.tie_embeddings:
        init = nnx.initializers.normal(c.initializer_range)
        shape = (c.hidden_size, c.vocab_size)
        setattr(model, "lm_head", _param(rngs, init, shape, c.base_dtype, ("embed", "vocab")))  # noqa: B010
    if c.lora is not None and c.lora.slots is not None:  # a bank: each slot's scale
        setattr(model, "lora_scale", LoRAScale(jnp.zeros((c.lora.slots,), jnp.float32)))  # noqa: B010


class Decoder(nnx.Module):
    """Embeddings, num_layers x (RMSNorm, GQA attention, RMSNorm, SwiGLU), RMSNorm, lm_head.

    With `tie_embeddings` the lm_head is the embedding matrix.
    """

    norm: nnx.Module  # set by `add_head`, as lm_head (untied) and lora_scale (a bank)
    lm_head: nnx.Param
    lora_scale: LoRAScale

    def __init__(self, config: DecoderConfig, rngs: nnx.Rngs | None = None):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        c = self.config = config
        self.embed_tokens = embedding(c, rngs)
        self.layers: Block | nnx.List
        if c.scan_layers:
            self.layers = Block(c, rngs, stack=c.num_layers)
        else:
            self.layers = nnx.List([Block(c, rngs) for _ in range(c.num_layers)])
        add_head(self, c, rngs, RMSNorm(c.hidden_size, c.rms_eps, c.dtype, c.base_dtype))

    # -- shared pieces

    def _inv_freq(self) -> jax.Array:
        return jnp.asarray(rope_inv_freq(self.config))

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [B, L] int -> [B, L, D] in the compute dtype."""
        return jnp.take(self.embed_tokens[...], tokens, axis=0).astype(self.config.dtype)

    def head(self) -> LMHead:
        """The output projection: the embedding [V, D] when tied, else lm_head [D, V]."""
        if self.config.tie_embeddings:
            return LMHead(self.embed_tokens[...], "vd")
        return LMHead(self.lm_head[...], "dv")

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final hidden states [..., D] (already normed, compute dtype) -> fp32 logits
        [..., V] (`head().logits`: the weight in the hidden states' dtype, fp32 sums)."""
        return self.head().logits(hidden)

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
        if c.sliding_window is not None and backend in ("pallas_gpu", "splash_tpu", "pallas_tpu"):
            return "dense"
        return backend

    def _layer_params(self):
        """The layers' params (and adapters) as a pure dict: stacked, or {i: layer i}."""
        return layer_params(self.config, self.layers)

    def _lora_rows(self, adapter_ids: jax.Array | None, batch: int):
        """(slot ids [B], scale [B]) of an adapter bank's rows (None: every row slot 0,
        the base model); None for a model without a bank."""
        c = self.config
        if c.lora is None or c.lora.slots is None:
            if adapter_ids is not None:
                raise ValueError(
                    "Decoder: adapter_ids given, but the model has no adapter bank "
                    "(DecoderConfig.lora.slots)"
                )
            return None
        ids = jnp.zeros((batch,), jnp.int32) if adapter_ids is None else adapter_ids
        ids = ids.astype(jnp.int32)
        return ids, jnp.take(self.lora_scale[...], ids, axis=0)

    # -- training / scoring

    def hidden_states(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        subtree_end: jax.Array | None = None,
        adapter_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Final normed hidden states [B, L, D] of packed rows (see `__call__`).
        adapter_ids [B] int: each row's slot of an adapter bank (`models.lora`)."""
        _check_2d(tokens=tokens, positions=positions, segment_ids=segment_ids)
        c = self.config
        lora = self._lora_rows(adapter_ids, tokens.shape[0])
        backend = self._backend("flat" if subtree_end is None else "tree", tokens.shape[1])
        packed = AttentionMask.packed(
            segment_ids, subtree_end, positions=positions, window=c.sliding_window
        )
        mask: AttentionMask | jax.Array = packed.dense() if backend == "dense" else packed
        rope = rope_cos_sin(positions, self._inv_freq())  # once for all layers

        def layer(w, x, rope, mask):
            return block_apply(c, w, x, rope, mask, backend, lora=lora)[0]

        if c.remat != "none":
            policy = _POLICIES[str(c.remat)]  # a bool remat is a name after __post_init__
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=not c.scan_layers)
        x = self.embed(tokens)
        params = self._layer_params()
        if c.scan_layers:
            x, _ = jax.lax.scan(lambda x, w: (layer(w, x, rope, mask), None), x, params)
        else:
            for i in range(c.num_layers):
                x = layer(params[i], x, rope, mask)
        return self.norm(x)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        subtree_end: jax.Array | None = None,
        adapter_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Logits of packed rows.

        tokens, positions (restart at 0 per segment), segment_ids (1.. per
        row, 0 = padding), subtree_end (tree packing only): [B, L] int.
        Returns fp32 logits [B, L, V]; logits[b, p] predicts the token after p.
        """
        hidden = self.hidden_states(tokens, positions, segment_ids, subtree_end, adapter_ids)
        return self.logits(hidden)

    # -- sampling with a KV cache

    def init_cache(self, batch: int, max_len: int, dtype=None) -> KVCache:
        """An empty cache for `batch` rows of up to `max_len` positions each.

        dtype defaults to the compute dtype. The cache is a pytree (KVCache);
        pass it through `jax.jit` and donate it to update in place.
        """
        c = self.config
        dt = c.dtype if dtype is None else dtype
        W = c.sliding_window
        meta = {} if W is None else {"window": W, "length": max_len}
        S = KVCache.slots_for(max_len, W)  # a ring of W slots when max_len > W
        if c.scan_layers:
            shape = (batch, S, c.num_layers, c.num_kv_heads * c.head_dim)
            return KVCache(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt), **meta)
        shape = (batch, c.num_kv_heads, S, c.head_dim)
        return KVCache(
            k=tuple(jnp.zeros(shape, dt) for _ in range(c.num_layers)),
            v=tuple(jnp.zeros(shape, dt) for _ in range(c.num_layers)),
            **meta,
        )

    def decode(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        *,
        logits_at: jax.Array | None = None,
        adapter_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Runs T new tokens per row against the cache: prefill (T > 1) or a step (T = 1).

        tokens [B, T] int; positions [B, T] int: the position of each token in
        its row's sequence (0 for the first prompt token), which is also its
        cache slot. Use -1 for padding (left or right): padding writes nothing.
        Positions must be < cache.max_len (larger ones are silently dropped).
        Query (b, t) attends to slots 0..positions[b, t] of row b, which hold
        this call's tokens and everything the row wrote before. A row can be
        reused for a new request by prefilling it from position 0 again.

        Returns (logits, new_cache). logits is fp32 [B, T, V], or [B, V] when
        `logits_at` [B] int is given (the logits of token t = logits_at[b] of
        each row, e.g. the last prompt token after prefill). Shapes are static,
        so jit it once per (B, T); a step costs O(max_len) attention and O(1)
        everything else. adapter_ids [B] int: each row's slot of an adapter bank
        (`models.lora`; None: slot 0, the base model).
        """
        _check_2d(tokens=tokens, positions=positions)
        c = self.config
        if cache.stacked != c.scan_layers or cache.num_layers != c.num_layers:
            layout = lambda stacked: "stacked" if stacked else "per-layer"  # noqa: E731
            raise ValueError(
                f"decode: cache is {layout(cache.stacked)} with "
                f"{cache.num_layers} layers, the model wants "
                f"{layout(c.scan_layers)} with {c.num_layers}; build it with "
                "model.init_cache"
            )
        if cache.batch != tokens.shape[0]:
            raise ValueError(f"decode: cache batch {cache.batch} != tokens batch {tokens.shape[0]}")
        if cache.window != c.sliding_window:
            raise ValueError(
                f"decode: cache window {cache.window} != the model's sliding_window "
                f"{c.sliding_window}; build it with model.init_cache"
            )
        S = cache.max_len
        positions = positions.astype(jnp.int32)
        slots = jnp.where(positions >= 0, positions, S)  # S is out of bounds: the write is dropped
        backend = self._backend("decode", tokens.shape[1])
        append = False
        if cache.ring:
            assert cache.window is not None  # a ring has one
            structure, slots, append = _ring_mask(positions, cache.slots, cache.window)
        else:
            structure = AttentionMask.decode(positions, S, c.sliding_window)
        mask: AttentionMask | jax.Array = structure
        if c.sliding_window is not None and backend == "dense":
            mask = structure.dense()
        elif backend == "dense":  # = mask.dense(); written as before, so the compiled step
            # (and its fp32 rounding) is unchanged for the sampler
            mask = (jnp.arange(S)[None, None, :] <= positions[:, :, None]) & (positions >= 0)[
                :, :, None
            ]
        rope = rope_cos_sin(jnp.maximum(positions, 0), self._inv_freq())  # once for all layers
        lora = self._lora_rows(adapter_ids, tokens.shape[0])
        layer = functools.partial(block_apply, c, rope=rope, mask=mask, backend=backend, lora=lora)
        x = self.embed(tokens)
        params = self._layer_params()
        ck, cv = cache.k, cache.v
        if c.scan_layers:  # layers read the cache; their new keys / values are written after

            def body(x, xs):
                w, i = xs
                x, (k_new, v_new, *_) = layer(w, x, cache=(ck, cv, i, slots, append))
                return x, (k_new, v_new)

            x, (k_new, v_new) = jax.lax.scan(body, x, (params, jnp.arange(c.num_layers)))
            rows = jnp.arange(tokens.shape[0])[None, :, None]
            at = (rows, slots[None], jnp.arange(c.num_layers)[:, None, None])
            assert not isinstance(ck, tuple) and not isinstance(cv, tuple)  # a scan cache
            ck = ck.at[at].set(k_new, mode="drop")  # [layers, B, T, F] into [B, S, layers, F]
            cv = cv.at[at].set(v_new, mode="drop")
        else:
            ks, vs = list(ck), list(cv)
            for i in range(c.num_layers):
                x, (ks[i], vs[i], *_) = layer(
                    params[i], x, cache=(ks[i], vs[i], None, slots, append)
                )
            ck, cv = tuple(ks), tuple(vs)
        x = self.norm(x)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at.astype(jnp.int32)[:, None, None], axis=1)[:, 0]
        return self.logits(x), KVCache(k=ck, v=cv, window=cache.window, length=cache.length)


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


def _check_2d(**arrays):
    for name, a in arrays.items():
        if a is not None and getattr(a, "ndim", None) != 2:
            raise ValueError(
                f"Decoder: {name} must be [batch, length], got shape {getattr(a, 'shape', None)}"
            )
