"""MoEDecoder: the decoder with mixture-of-experts MLPs (Qwen3-MoE, Qwen2-MoE).

The attention, norms, RoPE and dense MLP layers are the decoder's (`models.layers`,
`models.decoder`), the shell and the KV cache the skeleton's (`models.skeleton`: MoE's
routing stats are its layers' outputs, replayed routing their inputs); the layers
of `config.moe_layers` have a router and E SwiGLU experts instead of the dense MLP
(`models.moe`). It meets
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

import jax
import jax.numpy as jnp
from flax import nnx

from ac2_jax.models.decoder import Decoder
from ac2_jax.models.layers import (
    MLP,
    Block,
    _param,
    attention_apply,
    block_apply,
    from_bits,
    mlp_apply,
    rms_norm,
)
from ac2_jax.models.moe import (
    MoEDecoderConfig,
    RouterStats,
    experts_apply,
    grouped_matmul_for,
    route,
)
from ac2_jax.models.skeleton import Run

__all__ = ["MoEDecoder", "SparseMoE", "sparse_moe_apply"]


class SparseMoE(nnx.Module):
    """The router `gate` [D, E], the E SwiGLU experts (`layers.MLP` stored [E, in, out],
    logical axis "expert" first), and Qwen2-MoE's shared expert if any."""

    def __init__(self, c: MoEDecoderConfig, rngs: nnx.Rngs, stack: int | None = None):
        init = nnx.initializers.normal(c.initializer_range)
        D, pd = c.hidden_size, c.base_dtype
        self.gate = _param(rngs, init, (D, c.num_experts), pd, ("embed", None), stack)
        self.experts = MLP(c, rngs, stack, c.moe_intermediate_size, experts=c.num_experts)
        if c.shared_expert_intermediate_size:
            self.shared_expert = MLP(c, rngs, stack, c.shared_expert_intermediate_size)
            self.shared_expert_gate = _param(rngs, init, (D, 1), pd, ("embed", None), stack)


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
    STACKS = ("layers", "dense_layers")
    dense_layers: Block | None

    def build_layer(self, config, rngs, stack, count=None):
        # a MoE layer: the decoder's attention and norms, a `SparseMoE` for the MLP
        return Block(config, rngs, count, mlp=SparseMoE if stack == "layers" else MLP)

    def layer_stack(self, i: int) -> str:
        return "layers" if i in self.config.moe_layers else "dense_layers"

    def block(self, stack: str, w: dict, x, rope, mask, run: Run, cache=None, inputs=None):
        c = self.config
        if stack == "layers":
            return moe_block_apply(
                c, w, x, rope, mask, run.backend, run.real, cache, run.lora, replay=inputs
            )
        x, cache = block_apply(c, w, x, rope, mask, run.backend, cache, run.lora)
        return x, cache, None

    # -- training / scoring

    def layer_inputs(self, shape, routing: jax.Array | None = None, **inputs) -> dict:
        """routing: None (route by the model's own top k) or recorded experts
        [B, L, n_moe, k] int to replay (negative: that token routes itself), for
        `hidden_states(..., routing=)` / `__call__` / `forward_with_router`."""
        super().layer_inputs(shape, **inputs)  # refuses any other
        if routing is None:
            return {}
        c = self.config
        want = (*shape, len(c.moe_layers), c.num_experts_per_tok)
        if tuple(routing.shape) != want:
            raise ValueError(
                f"MoEDecoder: routing must be [batch, length, moe layers, k] = {want}, "
                f"got {tuple(routing.shape)}"
            )
        return {"layers": jnp.moveaxis(jnp.asarray(routing, jnp.int32), 2, 0)}

    def forward_with_router(self, tokens, positions, segment_ids, *args, **kwargs):
        """(final normed hidden states [B, L, D], RouterStats) of packed rows (the
        arguments of `forward`, and `routing`: `layer_inputs`)."""
        x, outs = self.forward(tokens, positions, segment_ids, *args, **kwargs)
        ids, counts, prob_sum, dropped = outs["layers"]
        stats = RouterStats(
            experts=jnp.moveaxis(ids, 0, 2),
            counts=counts,
            prob_sum=prob_sum,
            tokens=jnp.sum(segment_ids > 0).astype(jnp.float32),
            dropped=dropped,
        )
        return x, stats

    # -- sampling with a KV cache

    def decode(self, *args, return_routing: bool = False, **kwargs):
        """`Transformer.decode_with_outputs`' arguments and contract, (logits, new cache); with
        `return_routing` also the experts each new token went to, [B, T, n_moe, k]
        int32 (padding tokens' ids are meaningless)."""
        logits, cache, outs = self.decode_with_outputs(*args, **kwargs)
        if return_routing:
            return logits, cache, jnp.moveaxis(outs["layers"][0], 0, 2)
        return logits, cache
