"""Mixture of experts: the MoE decoder's config, and its math (router, top-k or
replayed routing, grouped expert GEMMs, the load-balancing loss).

`MoEDecoderConfig` is a `DecoderConfig` (attention, norms, dense MLP layers as
the decoder's) with the experts' fields of transformers' Qwen3MoeConfig /
Qwen2MoeConfig. The math is pure functions of param dicts (as
`models.layers`), so the MoE decoder (`models.moe_decoder`) runs them in a
Python loop or under `jax.lax.scan`.

Routing (Qwen3-MoE / Qwen2-MoE, as transformers computes it): router logits
x @ W_r, softmax over the experts (fp32), the top k, renormalised to sum 1
when `norm_topk_prob`. The router runs in fp32 whatever the compute dtype.
Routing replay (R3): given the experts a sampler recorded for each token,
the layer uses those instead of its own top k; their gate weights are the
layer's own softmax probabilities at the recorded experts (renormalised as
the config says), so gradients flow through the router as usual. A token
whose recorded ids hold a negative entry (not recorded) routes itself.

Experts (`experts_apply`): the token-expert assignments are sorted by expert
and each projection is one grouped GEMM over the sorted rows,
`jax.lax.ragged_dot` (dropless: every assignment is computed). With a
capacity (`capacity_factor`), each expert takes at most C assignments into a
[E, C, D] buffer and the projections are one batched matmul each (GShard);
assignments past an expert's capacity are dropped (their token gets nothing
from that expert) and COUNTED (`RouterStats.dropped`). Padding tokens take
no group and no capacity. No [tokens, E, F] array is ever formed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from ac2_jax.models.config import DecoderConfig
from ac2_jax.models.kernels.gmm import gmm

__all__ = [
    "MoEDecoderConfig",
    "RouterStats",
    "capacity_of",
    "GROUPED_MATMULS",
    "experts_apply",
    "grouped_matmul_for",
    "load_balancing_loss",
    "route",
]


@dataclasses.dataclass(frozen=True)
class MoEDecoderConfig(DecoderConfig):
    """A decoder whose MLP is a mixture of experts in some layers (`moe_layers`).

    num_experts (E), num_experts_per_tok (k), moe_intermediate_size (each
    expert's F), norm_topk_prob (renormalise the k gate weights),
    decoder_sparse_step / mlp_only_layers (which layers are MoE, as
    transformers picks them; the others are the decoder's dense SwiGLU MLP of
    `intermediate_size`), router_aux_loss_coef (the weight a trainer gives
    the load-balancing loss, `RouterStats.load_balancing_loss`; off unless a
    trainer adds it), shared_expert_intermediate_size (Qwen2-MoE's shared
    expert with its sigmoid gate; 0 = none, Qwen3-MoE).
    Runtime (not in config.json): capacity_factor None = dropless (grouped
    GEMMs over every assignment), else each expert takes at most
    ceil(factor * tokens * k / E) assignments per layer call and the rest are
    dropped and counted (`RouterStats.dropped`).
    """

    _: dataclasses.KW_ONLY  # every field past head_dim by keyword (ModelConfig)
    family: str = "qwen3_moe"
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    shared_expert_intermediate_size: int = 0
    capacity_factor: float | None = None

    # `tiny()`: a small MoE model for tests and CPU demos (8 experts, top 2, layer 0 dense).
    TINY: ClassVar[dict[str, Any]] = dict(
        DecoderConfig.TINY, num_layers=3, intermediate_size=64, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=(0,),
    )  # fmt: skip

    def __post_init__(self):
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        super().__post_init__()
        E, k, n = int(self.num_experts), int(self.num_experts_per_tok), self.num_layers
        if E < 1 or not 1 <= k <= E:
            raise ValueError(
                f"MoEDecoderConfig: need num_experts >= 1 and 1 <= num_experts_per_tok <= "
                f"num_experts, got num_experts={E}, num_experts_per_tok={k}"
            )
        for name in ("moe_intermediate_size", "decoder_sparse_step"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"MoEDecoderConfig.{name} must be >= 1, got {getattr(self, name)}")
        if int(self.shared_expert_intermediate_size) < 0:
            raise ValueError("MoEDecoderConfig.shared_expert_intermediate_size must be >= 0")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < n]
        if bad:
            raise ValueError(f"MoEDecoderConfig.mlp_only_layers {bad} are not layers 0..{n - 1}")
        if not self.moe_layers:
            raise ValueError(
                "MoEDecoderConfig: no layer is a mixture of experts (decoder_sparse_step="
                f"{self.decoder_sparse_step}, mlp_only_layers={list(self.mlp_only_layers)}); "
                "use a dense family (qwen3)"
            )
        if self.capacity_factor is not None and not float(self.capacity_factor) > 0:
            raise ValueError(
                f"MoEDecoderConfig.capacity_factor must be None (dropless) or > 0, "
                f"got {self.capacity_factor}"
            )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is the mixture of experts (transformers' rule)."""
        step, dense = int(self.decoder_sparse_step), set(self.mlp_only_layers)
        return tuple(i for i in range(self.num_layers) if i not in dense and (i + 1) % step == 0)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The layers with the dense SwiGLU MLP."""
        return tuple(i for i in range(self.num_layers) if i not in self.moe_layers)


@struct.dataclass
class RouterStats:
    """What the MoE layers of one forward routed (n = MoE layers, in layer order).

    experts: [B, L, n, k] int32, the experts each token went to (a sampler
    records them; the learner replays them). counts: [n, E] fp32, assignments
    of real tokens per expert (before any capacity drop); prob_sum: [n, E]
    fp32, the router probabilities of real tokens summed per expert (carries
    the router's gradient); tokens: fp32, real tokens; dropped: [n] int32,
    assignments dropped over capacity (0 when dropless).
    """

    experts: jax.Array
    counts: jax.Array
    prob_sum: jax.Array
    tokens: jax.Array
    dropped: jax.Array

    def load_balancing_loss(self) -> jax.Array:
        """The Switch-Transformer load-balancing loss, as transformers'
        `load_balancing_loss_func` over all MoE layers (its `aux_loss`)."""
        return load_balancing_loss(self.counts, self.prob_sum, self.tokens)


def load_balancing_loss(counts: jax.Array, prob_sum: jax.Array, tokens: jax.Array) -> jax.Array:
    """E * sum_e f_e * P_e with f_e = (assignments to e) / rows and P_e = (probability
    mass on e) / rows, rows = layers x real tokens, both summed over the layers
    first (transformers' definition). counts, prob_sum: [layers, E]."""
    n, E = counts.shape
    rows = n * jnp.maximum(tokens, 1.0)
    f = jax.lax.stop_gradient(counts).sum(0) / rows
    return E * jnp.sum(f * prob_sum.sum(0) / rows)


def route(
    logits: jax.Array, k: int, normalize: bool, replay: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(ids [N, k] int32, weights [N, k] fp32, probs [N, E] fp32) of router logits [N, E].

    ids: the top k of softmax(logits), or `replay` [N, k] where it was recorded
    (a token with a negative id takes its own top k); weights: the
    probabilities at ids, divided by their sum when `normalize`.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    _, ids = jax.lax.top_k(probs, k)
    ids = ids.astype(jnp.int32)
    if replay is not None:
        recorded = jnp.all(replay >= 0, axis=-1, keepdims=True)
        ids = jnp.where(recorded, replay.astype(jnp.int32), ids)
    weights = jnp.take_along_axis(probs, ids, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids, weights, probs


def capacity_of(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """Assignments one expert takes: ceil(factor * tokens * k / E), at most `tokens`."""
    return max(1, min(tokens, math.ceil(factor * tokens * k / num_experts)))


def experts_apply(
    x: jax.Array,
    ids: jax.Array,
    weights: jax.Array,
    real: jax.Array,
    wg: jax.Array,
    wu: jax.Array,
    wd: jax.Array,
    capacity_factor: float | None = None,
    grouped: str = "ragged_dot",
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """sum_j weights[n, j] * expert_{ids[n, j]}(x[n]) for x [N, D]; SwiGLU experts
    wg, wu [E, D, F], wd [E, F, D] (in x's dtype); real [N] bool (False: padding,
    routed nowhere, output 0). grouped: the dropless path's grouped GEMM,
    "ragged_dot" (`jax.lax.ragged_dot`) or "gmm" (the TPU Pallas kernel, megablox
    `gmm`, `grouped_matmul_for`; `interpret` runs it in Pallas interpret mode).
    Returns (y [N, D], group sizes [E] int32, dropped assignments int32)."""
    if grouped not in GROUPED_MATMULS:
        raise ValueError(
            f"experts_apply: grouped must be one of {GROUPED_MATMULS}, got {grouped!r}"
        )
    if grouped == "gmm" and capacity_factor is None:
        return _experts_gmm(x, ids, weights, real, wg, wu, wd, interpret)
    return _experts(x, ids, weights, real, wg, wu, wd, capacity_factor, jax.lax.ragged_dot)


def _experts(x, ids, weights, real, wg, wu, wd, capacity_factor, matmul):
    """`experts_apply` with `matmul(lhs [M, D], rhs [E, D, F], sizes [E])` the grouped GEMM."""
    N, D = x.shape
    k, E = ids.shape[1], wg.shape[0]
    live = jnp.repeat(real, k)
    key = jnp.where(live, ids.reshape(-1), E)  # padding sorts last, in no group
    order = jnp.argsort(key, stable=True)  # by expert, then token order
    key_sorted = jnp.take(key, order)
    sizes = jnp.zeros((E + 1,), jnp.int32).at[key].add(1)[:E]
    xs = jnp.take(x, order // k, axis=0)  # [N k, D], grouped by expert
    if capacity_factor is None:
        g = matmul(xs, wg, sizes)
        u = matmul(xs, wu, sizes)
        y = matmul(jax.nn.silu(g) * u, wd, sizes)
        y = jnp.where((key_sorted < E)[:, None], y, jnp.zeros_like(y))
        dropped = jnp.zeros((), jnp.int32)
    else:
        C = capacity_of(N, k, E, capacity_factor)
        starts = jnp.cumsum(sizes) - sizes
        rank = jnp.arange(N * k) - jnp.take(starts, jnp.minimum(key_sorted, E - 1))
        keep = (key_sorted < E) & (rank < C)
        slot = jnp.where(keep, key_sorted * C + rank, E * C)  # E * C: dropped
        buf = jnp.zeros((E * C, D), x.dtype).at[slot].set(xs, mode="drop").reshape(E, C, D)
        h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", buf, wg)) * jnp.einsum("ecd,edf->ecf", buf, wu)
        out = jnp.einsum("ecf,efd->ecd", h, wd).reshape(E * C, D)
        y = jnp.take(out, slot, axis=0, mode="fill", fill_value=0)
        dropped = jnp.sum((key_sorted < E) & ~keep).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(N * k, dtype=order.dtype))
    y = jnp.take(y, inverse, axis=0).reshape(N, k, D)
    return jnp.einsum("nkd,nk->nd", y, weights.astype(y.dtype)), sizes, dropped


GROUPED_MATMULS = ("ragged_dot", "gmm")


def grouped_matmul_for(attention_backend: str, platform: str | None = None) -> str:
    """The experts' grouped GEMM that goes with an attention backend: "gmm" where the
    TPU kernels run ("pallas_tpu", or "auto" when the target platform is TPU,
    `models.kernels.attention.target_platform`: a mesh set on TPU devices, also ahead of
    time on a CPU host), else "ragged_dot"."""
    from ac2_jax.models.kernels.attention import target_platform

    if attention_backend == "pallas_tpu":
        return "gmm"
    if attention_backend == "auto" and (platform or target_platform()) == "tpu":
        return "gmm"
    return "ragged_dot"


def _experts_gmm(x, ids, weights, real, wg, wu, wd, interpret):
    """The dropless experts through `gmm`; under a mesh (`jax.set_mesh`) in shard_map:
    tokens over the rules' "batch" axes (each shard sorts and groups its own), the
    experts' hidden width over their "mlp" axes (partial down projections summed),
    weights otherwise whole per shard (FSDP gathers them a layer at a time)."""
    matmul = functools.partial(gmm, interpret=interpret)
    run = lambda *a: _experts(*a, None, matmul)  # noqa: E731
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return run(x, ids, weights, real, wg, wu, wd)
    from jax.sharding import PartitionSpec as P

    from ac2_jax.models.axes import active_rules

    rules = active_rules()
    rows, hidden = rules.spec(("batch",), mesh)[0], rules.spec(("mlp",), mesh)[0]
    ways = lambda axes: math.prod(  # noqa: E731
        mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ())
    )
    rows = rows if x.shape[0] % ways(rows) == 0 else None
    hidden = hidden if wg.shape[2] % ways(hidden) == 0 else None
    names = lambda axes: () if axes is None else (axes,) if isinstance(axes, str) else axes  # noqa: E731

    def local(x, ids, weights, real, wg, wu, wd):
        y, sizes, dropped = run(x, ids, weights, real, wg, wu, wd)
        if names(hidden):
            y = jax.lax.psum(y, names(hidden))
        if names(rows):
            sizes, dropped = jax.lax.psum((sizes, dropped), names(rows))
        return y, sizes, dropped

    tok = P(rows)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(
            tok,
            tok,
            tok,
            tok,
            P(None, None, hidden),
            P(None, None, hidden),
            P(None, hidden, None),
        ),  # fmt: skip
        out_specs=(tok, P(), P()),
        check_vma=False,
    )(x, ids, weights, real, wg, wu, wd)
