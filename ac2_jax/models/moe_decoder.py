"""MoEDecoder: the decoder with mixture-of-experts MLPs (Qwen3-MoE, Qwen2-MoE).

The attention, norms, RoPE, KV cache and dense MLP layers are the decoder's
(`models.layers`, `models.decoder`); the layers of `config.moe_layers` have a
router and E SwiGLU experts instead of the dense MLP (`models.moe`). It meets
`CausalLM` and the decoder's cache API, with what MoE adds:

* `hidden_states(..., routing=None)` / `__call__(..., routing=None)`:
  `routing` [B, L, n, k] int (n = MoE layers in layer order, aligned with the
  input tokens) replays recorded experts (routing replay, R3) instead of
  the model's own top k; negative ids: that token routes itself.
* `forward_with_router(...)` -> (hidden, `RouterStats`): the experts each
  token went to, per-expert loads, dropped assignments, and the
  load-balancing loss (`stats.load_balancing_loss()`); a trainer adds
  `config.router_aux_loss_coef * stats.load_balancing_loss()` to its loss.
* `decode(..., return_routing=True)` -> (logits, cache, experts [B, T, n, k]):
  what a sampler records per token.

Layers: per layer (`layers.{i}`: a MoE block or a dense `Block`), or with
`scan_layers` two stacks, `layers` (the MoE layers, [n, ...]) and
`dense_layers` (the others), run as consecutive runs of one kind, each run
under `jax.lax.scan`; HF I/O maps both to `model.layers.{i}`.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from flax import nnx

from ac2_jax.models.decoder import (
    _POLICIES,
    Decoder,
    KVCache,
    _check_2d,
    _ring_mask,
    add_head,
    embedding,
)
from ac2_jax.models.kernels.attention_mask import AttentionMask
from ac2_jax.models.layers import (
    MLP,
    Attention,
    Block,
    RMSNorm,
    _param,
    attention_apply,
    block_apply,
    from_bits,
    layer_params,
    mlp_apply,
    rms_norm,
    rope_cos_sin,
)
from ac2_jax.models.moe import (
    MoEDecoderConfig,
    RouterStats,
    experts_apply,
    grouped_matmul_for,
    route,
)

__all__ = ["MoEBlock", "MoEDecoder", "SparseMoE", "sparse_moe_apply"]


class Experts(nnx.Module):
    """E SwiGLU experts, stored [E, in, out] (logical axis "expert" first)."""

    def __init__(self, c: MoEDecoderConfig, rngs: nnx.Rngs, stack: int | None = None):
        init = nnx.initializers.normal(c.initializer_range)
        E, D, F, pd = c.num_experts, c.hidden_size, c.moe_intermediate_size, c.base_dtype
        self.gate_proj = _param(rngs, init, (E, D, F), pd, ("expert", "embed", "mlp"), stack)
        self.up_proj = _param(rngs, init, (E, D, F), pd, ("expert", "embed", "mlp"), stack)
        self.down_proj = _param(rngs, init, (E, F, D), pd, ("expert", "mlp", "embed"), stack)


class SparseMoE(nnx.Module):
    """The router `gate` [D, E], the experts, and Qwen2-MoE's shared expert if any."""

    def __init__(self, c: MoEDecoderConfig, rngs: nnx.Rngs, stack: int | None = None):
        init = nnx.initializers.normal(c.initializer_range)
        D, pd = c.hidden_size, c.base_dtype
        self.gate = _param(rngs, init, (D, c.num_experts), pd, ("embed", None), stack)
        self.experts = Experts(c, rngs, stack)
        if c.shared_expert_intermediate_size:
            shared = c.replace(intermediate_size=c.shared_expert_intermediate_size)
            self.shared_expert = MLP(shared, rngs, stack)
            self.shared_expert_gate = _param(rngs, init, (D, 1), pd, ("embed", None), stack)


class MoEBlock(nnx.Module):
    """One MoE layer's params (or `stack` of them): the decoder's attention and norms,
    a `SparseMoE` for the MLP."""

    def __init__(self, c: MoEDecoderConfig, rngs: nnx.Rngs, stack: int | None = None):
        pd = c.base_dtype
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps, c.dtype, pd, stack)
        self.self_attn = Attention(c, rngs, stack)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps, c.dtype, pd, stack)
        self.mlp = SparseMoE(c, rngs, stack)


def sparse_moe_apply(
    c: MoEDecoderConfig,
    w: dict,
    x: jax.Array,
    real: jax.Array,
    replay: jax.Array | None = None,
    grouped: str = "ragged_dot",
):
    """The MoE MLP of x [B, L, D] (w: a SparseMoE's params); real [B, L] bool
    (False: padding); replay: None or recorded experts [B, L, k]; grouped: the
    experts' grouped GEMM (`moe.experts_apply`). Returns
    (y [B, L, D], (ids [B, L, k], counts [E], prob_sum [E], dropped))."""
    B, L, D = x.shape
    k, dt = c.num_experts_per_tok, c.dtype
    h = x.astype(dt).reshape(B * L, D)
    logits = jnp.einsum("nd,de->ne", h.astype(jnp.float32), w["gate"].astype(jnp.float32))
    rep = None if replay is None else replay.reshape(B * L, k)
    ids, weights, probs = route(logits, k, c.norm_topk_prob, rep)
    flat_real = real.reshape(B * L)
    ex = {n: w["experts"][n].astype(dt) for n in ("gate_proj", "up_proj", "down_proj")}
    y, sizes, dropped = experts_apply(
        h, ids, weights, flat_real, ex["gate_proj"], ex["up_proj"], ex["down_proj"],
        capacity_factor=c.capacity_factor, grouped=grouped,
    )  # fmt: skip
    y = y.reshape(B, L, D)
    if "shared_expert" in w:  # Qwen2-MoE: + sigmoid(x W_g) * MLP(x)
        gate = jax.nn.sigmoid(
            jnp.einsum("bld,do->blo", x.astype(dt), w["shared_expert_gate"].astype(dt))
        )
        y = y + gate.astype(dt) * mlp_apply(c, w["shared_expert"], x)
    prob_sum = jnp.sum(jnp.where(flat_real[:, None], probs, 0.0), axis=0)
    stats = (ids.reshape(B, L, k), sizes.astype(jnp.float32), prob_sum, dropped)
    return y, stats


def moe_block_apply(c, w, x, rope, mask, backend, real, cache=None, lora=None, replay=None):
    """One MoE layer: x + attn(norm x), then + moe(norm x). Returns (x, cache, stats).
    backend: the attention kernel that runs; with the TPU one ("pallas_tpu") the
    experts run through the TPU grouped GEMM (`moe.grouped_matmul_for`)."""
    w = from_bits(c, w)
    h = rms_norm(w["input_layernorm"]["weight"], x, c.rms_eps, c.dtype)
    a, cache = attention_apply(c, w["self_attn"], h, rope, mask, backend, cache, lora)
    x = x + a
    h = rms_norm(w["post_attention_layernorm"]["weight"], x, c.rms_eps, c.dtype)
    y, stats = sparse_moe_apply(c, w["mlp"], h, real, replay, grouped_matmul_for(backend))
    return x + y, cache, stats


class MoEDecoder(Decoder):
    """Embeddings, layers (MoE or dense MLP), final norm, lm_head (see the module doc)."""

    config: MoEDecoderConfig

    def __init__(self, config: MoEDecoderConfig, rngs: nnx.Rngs | None = None):
        rngs = nnx.Rngs(0) if rngs is None else rngs
        c = self.config = config
        self.embed_tokens = embedding(c, rngs)
        self.dense_layers: Block | None
        if c.scan_layers:
            self.layers = MoEBlock(c, rngs, stack=len(c.moe_layers))  # type: ignore[assignment]
            dense = len(c.dense_layers)
            self.dense_layers = Block(c, rngs, stack=dense) if dense else None
        else:
            self.dense_layers = None
            moe = set(c.moe_layers)
            self.layers = nnx.List(
                [MoEBlock(c, rngs) if i in moe else Block(c, rngs) for i in range(c.num_layers)]
            )
        add_head(self, c, rngs, RMSNorm(c.hidden_size, c.rms_eps, c.dtype, c.base_dtype))

    def _runs(self) -> list[tuple[bool, int, int, int]]:
        """(is_moe, first layer, layers, offset in its stack) of each run of layers of
        one kind, in layer order."""
        moe, runs, seen = set(self.config.moe_layers), [], {True: 0, False: 0}
        for kind, group in itertools.groupby(range(self.config.num_layers), lambda i: i in moe):
            layers = list(group)
            runs.append((kind, layers[0], len(layers), seen[kind]))
            seen[kind] += len(layers)
        return runs

    def _apply_layers(self, x, layer, replay):
        """Runs every layer: layer(is_moe, w, x, index, replay_i) -> (x, (kv, stats)).
        replay: None or [n_moe, B, L, k]. Returns (x, kvs in layer order: a list
        (per-layer) or arrays [num_layers, ...] (stacked), stats stacked [n_moe, ...])."""
        c = self.config
        kvs, stats = [], []
        if not c.scan_layers:
            params = layer_params(c, self.layers)
            moe_pos = {i: j for j, i in enumerate(c.moe_layers)}
            for i in range(c.num_layers):
                j = moe_pos.get(i)
                rep = None if replay is None or j is None else replay[j]
                x, (kv, st) = layer(j is not None, params[i], x, i, rep)
                kvs.append(kv)
                if st is not None:
                    stats.append(st)
            return x, kvs, jax.tree.map(lambda *a: jnp.stack(a), *stats)
        stacks = {True: layer_params(c, self.layers)}
        if self.dense_layers is not None:
            stacks[False] = layer_params(c, self.dense_layers)
        for is_moe, first, n, off in self._runs():
            w = stacks[is_moe]
            if n != len(c.moe_layers if is_moe else c.dense_layers):
                w = jax.tree.map(lambda a, off=off, n=n: a[off : off + n], w)
            rep = None if replay is None or not is_moe else replay[off : off + n]
            xs = (w, jnp.arange(first, first + n), rep)
            fn = functools.partial(layer, is_moe)
            x, (kv, st) = jax.lax.scan(lambda x, xs, fn=fn: fn(xs[0], x, xs[1], xs[2]), x, xs)
            kvs.append(kv)
            if st is not None:
                stats.append(st)
        kv_all = None if kvs[0] is None else jax.tree.map(lambda *a: jnp.concatenate(a), *kvs)
        return x, kv_all, jax.tree.map(lambda *a: jnp.concatenate(a), *stats)

    # -- training / scoring

    def forward_with_router(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        subtree_end: jax.Array | None = None,
        adapter_ids: jax.Array | None = None,
        *,
        routing: jax.Array | None = None,
    ) -> tuple[jax.Array, RouterStats]:
        """(final normed hidden states [B, L, D], RouterStats) of packed rows.
        routing: None (route by the model's own top k) or recorded experts
        [B, L, n_moe, k] int to replay (negative: that token routes itself)."""
        _check_2d(tokens=tokens, positions=positions, segment_ids=segment_ids)
        c = self.config
        replay = self._replay(routing, tokens.shape)
        lora = self._lora_rows(adapter_ids, tokens.shape[0])
        backend = self._backend("flat" if subtree_end is None else "tree", tokens.shape[1])
        packed = AttentionMask.packed(
            segment_ids, subtree_end, positions=positions, window=c.sliding_window
        )
        mask: AttentionMask | jax.Array = packed.dense() if backend == "dense" else packed
        rope = rope_cos_sin(positions, self._inv_freq())
        real = segment_ids > 0

        def layer(is_moe, w, x, i, rep):
            if is_moe:
                x, _, st = moe_block_apply(
                    c, w, x, rope, mask, backend, real, lora=lora, replay=rep
                )
                return x, (None, st)
            return block_apply(c, w, x, rope, mask, backend, lora=lora)[0], (None, None)

        if c.remat != "none":
            remat = functools.partial(
                jax.checkpoint, policy=_POLICIES[str(c.remat)], prevent_cse=not c.scan_layers,
                static_argnums=(0,),
            )  # fmt: skip
            layer = remat(layer)
        x, _, st = self._apply_layers(self.embed(tokens), layer, replay)
        return self.norm(x), self._stats(st, real)

    def hidden_states(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        subtree_end: jax.Array | None = None,
        adapter_ids: jax.Array | None = None,
        *,
        routing: jax.Array | None = None,
    ) -> jax.Array:
        """Final normed hidden states [B, L, D] (`forward_with_router`'s first part)."""
        return self.forward_with_router(
            tokens, positions, segment_ids, subtree_end, adapter_ids, routing=routing
        )[0]

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array,
        subtree_end: jax.Array | None = None,
        adapter_ids: jax.Array | None = None,
        *,
        routing: jax.Array | None = None,
    ) -> jax.Array:
        """fp32 logits [B, L, V] of packed rows (as `Decoder.__call__`; routing as
        `forward_with_router`)."""
        hidden = self.hidden_states(
            tokens, positions, segment_ids, subtree_end, adapter_ids, routing=routing
        )
        return self.logits(hidden)

    def _replay(self, routing, shape):
        """Recorded routing [B, L, n, k] -> [n, B, L, k] (checked), or None."""
        if routing is None:
            return None
        c = self.config
        want = (*shape, len(c.moe_layers), c.num_experts_per_tok)
        if tuple(routing.shape) != want:
            raise ValueError(
                f"MoEDecoder: routing must be [batch, length, moe layers, k] = {want}, "
                f"got {tuple(routing.shape)}"
            )
        return jnp.moveaxis(jnp.asarray(routing, jnp.int32), 2, 0)

    def _stats(self, st, real) -> RouterStats:
        ids, counts, prob_sum, dropped = st
        return RouterStats(
            experts=jnp.moveaxis(ids, 0, 2),
            counts=counts,
            prob_sum=prob_sum,
            tokens=jnp.sum(real).astype(jnp.float32),
            dropped=dropped,
        )

    # -- sampling with a KV cache

    def decode(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        *,
        logits_at: jax.Array | None = None,
        adapter_ids: jax.Array | None = None,
        return_routing: bool = False,
    ):
        """`Decoder.decode` (same arguments, same contract: (logits, new cache)); with
        `return_routing` also the experts each new token went to, [B, T, n_moe, k]
        int32 (padding tokens' ids are meaningless)."""
        _check_2d(tokens=tokens, positions=positions)
        c = self.config
        if cache.stacked != c.scan_layers or cache.num_layers != c.num_layers:
            raise ValueError(
                f"decode: the cache (stacked={cache.stacked}, {cache.num_layers} layers) is "
                f"not this model's (stacked={c.scan_layers}, {c.num_layers}); build it with "
                "model.init_cache"
            )
        if cache.batch != tokens.shape[0] or cache.window != c.sliding_window:
            raise ValueError(
                f"decode: cache batch {cache.batch} / window {cache.window} != tokens batch "
                f"{tokens.shape[0]} / sliding_window {c.sliding_window}; use model.init_cache"
            )
        S = cache.max_len
        positions = positions.astype(jnp.int32)
        slots = jnp.where(positions >= 0, positions, S)
        backend = self._backend("decode", tokens.shape[1])
        append = False
        if cache.ring:
            assert cache.window is not None
            structure, slots, append = _ring_mask(positions, cache.slots, cache.window)
        else:
            structure = AttentionMask.decode(positions, S, c.sliding_window)
        mask: AttentionMask | jax.Array = structure.dense() if backend == "dense" else structure
        rope = rope_cos_sin(jnp.maximum(positions, 0), self._inv_freq())
        lora = self._lora_rows(adapter_ids, tokens.shape[0])
        real = positions >= 0
        ck, cv = cache.k, cache.v

        def layer(is_moe, w, x, i, rep):
            if c.scan_layers:
                kv = (ck, cv, i, slots, append)
            else:
                kv = (ck[i], cv[i], None, slots, append)
            if is_moe:
                x, kv, st = moe_block_apply(c, w, x, rope, mask, backend, real, kv, lora)
            else:
                (x, kv), st = block_apply(c, w, x, rope, mask, backend, kv, lora), None
            return x, (kv[:2], st)

        x, kvs, st = self._apply_layers(self.embed(tokens), layer, None)
        if c.scan_layers:
            k_new, v_new = kvs
            rows = jnp.arange(tokens.shape[0])[None, :, None]
            at = (rows, slots[None], jnp.arange(c.num_layers)[:, None, None])
            assert not isinstance(ck, tuple) and not isinstance(cv, tuple)
            ck = ck.at[at].set(k_new, mode="drop")
            cv = cv.at[at].set(v_new, mode="drop")
        else:
            ck, cv = tuple(kv[0] for kv in kvs), tuple(kv[1] for kv in kvs)
        x = self.norm(x)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at.astype(jnp.int32)[:, None, None], axis=1)[:, 0]
        out = self.logits(x), KVCache(k=ck, v=cv, window=cache.window, length=cache.length)
        return (*out, jnp.moveaxis(st[0], 0, 2)) if return_routing else out
