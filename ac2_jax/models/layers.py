"""The decoder's layer: modules that hold params, pure functions that apply them.

A `Block` holds one layer's params, or with `stack=n` all n layers' params
stacked on a leading axis (logical axis "layers"). The math is
in pure functions of the params as a nested dict of arrays
(`nnx.to_pure_dict` of a Block's state), so the decoder can run the layers
in a Python loop or under `jax.lax.scan` with the same code.
Weights are stored [in, out] (HF stores [out, in]; `hf_io` transposes).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ac2_jax.models.axes import active_rules
from ac2_jax.models.config import ModelConfig
from ac2_jax.models.kernels.attention import attention
from ac2_jax.models.lora import lora_delta


def _param(
    rngs: nnx.Rngs | None, init, shape, dtype, names, stack: int | None = None, kind=nnx.Param
) -> nnx.Param:
    """A Param (or a subclass `kind`, e.g. `nnx.LoRAParam`) annotated with logical
    axis names (`models.axes`; a leading "layers" when stacked). Under a mesh
    (`jax.set_mesh`) it is sharded now, by the active rules (`axes.axis_rules`,
    default `DEFAULT_RULES`)."""
    if stack is not None:
        shape, names = (stack, *shape), ("layers", *names)
    value = init(rngs.params() if rngs is not None else None, shape, dtype)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        spec, _ = active_rules().fit(names, shape, mesh, f"a param {tuple(shape)} {names}")
        value = jax.lax.with_sharding_constraint(value, spec)
    return kind(value, out_sharding=names, eager_sharding=False)


def _ones(_key, shape, dtype):
    return jnp.ones(shape, dtype)


def _zeros(_key, shape, dtype):
    return jnp.zeros(shape, dtype)


# ----------------------------------------------------------------------------- layer params


def layer_params(c: ModelConfig, layers: nnx.Module) -> dict:
    """The params (and adapters) of a model's layers as a pure dict for its layer
    loop: stacked [num_layers, ...] or {i: layer i}.

    A LoRA model's frozen 16-bit base weights (`LoRAConfig.base_dtype`) travel as
    their bits (uint16) and each layer turns them back inside the loop body
    (`from_bits`, first thing in every block). Why: XLA:CPU slices no bf16
    array; its float normalisation rewrites the scan's per-layer dynamic-slice
    into a slice of an fp32 copy of the whole stack, which it then hoists out of
    the loop: an fp32 copy of every layer's base weights live through the step,
    more memory than the 16-bit base saved (docs/notes/2026-12-05-lora-frozen-bf16-base.md).
    Integer slices stay 16-bit. Bits carry no gradient, so only frozen weights (never an
    adapter's A or B) take this form.
    """
    params = nnx.to_pure_dict(nnx.state(layers, nnx.Param))
    if not _has_bits(c):
        return params

    def bits(path, x):
        frozen = not _is_adapter([str(getattr(k, "key", k)) for k in path])
        return _bitcast(x, jnp.uint16) if frozen and x.dtype == c.base_dtype else x

    return jax.tree_util.tree_map_with_path(bits, params)


def from_bits(c: ModelConfig, w: dict) -> dict:
    """One layer's params as `layer_params` passed them, with its frozen 16-bit base
    weights back in `c.base_dtype` (no uint16 param exists otherwise)."""
    if c.lora is None:
        return w
    return jax.tree.map(lambda x: _bitcast(x, c.base_dtype) if x.dtype == jnp.uint16 else x, w)


def _has_bits(c) -> bool:
    """Whether a model of config `c` holds frozen 16-bit base weights (LoRA)."""
    return getattr(c, "lora", None) is not None and jnp.dtype(c.base_dtype).itemsize == 2


def _is_adapter(keys: list[str]) -> bool:
    return any(k.endswith("_lora") for k in keys)


def _bitcast(x, dtype):
    """x with its bits read as `dtype` (same width); a ShapeDtypeStruct's dtype alone."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
    return jax.lax.bitcast_convert_type(x, dtype)


def frozen_bits(model, state: nnx.State, to_bits: bool = True) -> nnx.State:
    """`state` (`model`'s variables, or ShapeDtypeStructs of them) with a LoRA model's
    frozen 16-bit layer weights as uint16 bits (`to_bits`), or back in its config's
    `base_dtype`. The layer weights are those under the model's `param_stacks`
    (`models.skeleton.Transformer`: its `STACKS`, or `layers` per-layer); a model
    without config or stacks is returned as is.

    A train state keeps them as bits (`training.core.create_train_state`), so the step
    receives the bits and slices them per layer with no copy at all: turning a bf16
    stack into bits inside the step is a real copy on XLA:CPU (a 16-bit copy of every
    layer, live through the step). `TrainState.model` turns them back. The embedding,
    head, final norm and every adapter keep their dtype."""
    c = getattr(model, "config", None)
    if c is None or not _has_bits(c):
        return state
    stacks = getattr(model, "param_stacks", ())
    src, dst = (jnp.dtype(c.base_dtype), jnp.dtype(jnp.uint16))
    if not to_bits:
        src, dst = dst, src
    leaves = []
    for path, var in nnx.to_flat_state(state):
        keys = [str(k) for k in path]
        if keys[0] in stacks and not _is_adapter(keys) and var.dtype == src:
            var = var.replace(_bitcast(var.get_value(), dst))
        leaves.append((path, var))
    return nnx.from_flat_state(leaves)


# ----------------------------------------------------------------------------- pure pieces


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse RoPE frequencies [head_dim // 2] (HF default, or llama3 scaling)."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    sc = config.rope_scaling
    if sc is not None and sc.get("rope_type", sc.get("type")) == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old / lo, old / hi
        scaled = np.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """RoPE's (cos, sin) tables [B, L, 1, hd] (fp32) for positions [B, L].

    Every layer rotates with the same tables, so the decoder builds them once per
    forward and passes them down instead of recomputing sin/cos in every layer
    (RoPE was 4-6% of the train step, docs/notes/2026-12-02-where-the-step-time-goes-profiles.md).
    """
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, L, hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
    return jnp.cos(emb), jnp.sin(emb)


def rotate(x: jax.Array, cos_sin: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotate-half RoPE (HF convention) of x [B, L, H, hd] with `rope_cos_sin` tables."""
    cos, sin = cos_sin
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE (HF convention). x [B, L, H, hd], positions [B, L]."""
    return rotate(x, rope_cos_sin(positions, inv_freq))


def rms_norm(weight: jax.Array, x: jax.Array, eps: float, dtype) -> jax.Array:
    """x / rms(x) * weight over the last axis, computed in fp32 (as HF does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(dtype) * xf.astype(dtype)


def _dot(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
    """x [..., in] @ w [in, out] in the compute dtype."""
    return jnp.einsum("...i,io->...o", x, w.astype(dtype))


def _proj(c: ModelConfig, x: jax.Array, w: dict, name: str, lora=None) -> jax.Array:
    """Attention projection `name` ("q", "k", "v", "o"): x [..., in] @ w[name_proj]
    [in, out] in the compute dtype, through `linear`'s VJP when `c.proj_backward`
    is "custom", plus its LoRA adapter's delta where it has one (`_adapted`)."""
    wp = w[f"{name}_proj"]
    if c.proj_backward == "custom":
        y = linear(x.astype(c.dtype), wp.astype(c.dtype))
    else:
        y = _dot(x, wp, c.dtype)
    return _adapted(c, y, x, w, name, lora)


def _adapted(c: ModelConfig, y: jax.Array, x: jax.Array, w: dict, name: str, lora) -> jax.Array:
    """y plus the LoRA delta of projection `name` on input x, if `w` holds its
    adapter (`w[name_lora]`, `models.lora`). lora: None, or (slot ids [B], scale
    [B]) for a bank of adapters."""
    lw = w.get(f"{name}_lora")
    if lw is None:
        return y
    scale = c.lora.scale if c.lora is not None else None
    return y + lora_delta(x.astype(c.dtype), lw, scale, lora, c.dtype)


def attention_apply(
    c: ModelConfig,
    w: dict,
    x: jax.Array,
    rope: tuple[jax.Array, jax.Array],
    mask,
    backend: str,
    cache=None,
    lora=None,
):
    """Self-attention of one layer. x [B, L, D]; w: the `self_attn` params;
    rope: the (cos, sin) tables of `rope_cos_sin` for x's positions.

    mask: an AttentionMask or a dense [B, L, S] bool mask (see
    `models.kernels.attention.attention`). cache: None, or (k, v, layer, slots, append)
    with the slots [B, L] of the new keys / values (index S drops a write);
    attention runs over the layer's whole cache with them written in, or with
    `append` over the cache as it was followed by the new keys ([S + L] keys:
    a sliding-window ring's chunk, `skeleton._ring_mask`).
    Per-layer (layer None): k, v are this layer's caches [B, K, S, hd]
    (heads-major, so decode reads them in place) and come back updated.
    Stacked: k, v are all layers' caches [B, S, num_layers, K * hd], read only;
    layer is this layer's index, and the new keys / values [B, L, K * hd] come
    back in their place (the caller writes them once for all layers: a
    loop-carried cache would be copied per layer).
    lora: None, or a bank's (slot ids [B], scale [B]) (`_adapted`).
    Returns (out [B, L, D], cache).
    """
    B, L, _ = x.shape
    H, K, hd, dt = c.num_heads, c.num_kv_heads, c.head_dim, c.dtype
    q, k, v = (_proj(c, x, w, n, lora) for n in "qkv")
    if c.attention_bias:  # Qwen2: q/k/v biases (o has none)
        q, k, v = (y + w[f"{n}_bias"].astype(dt) for y, n in zip((q, k, v), "qkv", strict=True))
    q, k, v = q.reshape(B, L, H, hd), k.reshape(B, L, K, hd), v.reshape(B, L, K, hd)
    if c.qk_norm:
        q = rms_norm(w["q_norm"]["weight"], q, c.rms_eps, dt)
        k = rms_norm(w["k_norm"]["weight"], k, c.rms_eps, dt)
    q, k = rotate(q, rope), rotate(k, rope)
    if cache is not None:
        ck, cv, layer, slots, append = cache
        rows = jnp.arange(B)[:, None]
        if layer is None:  # [B, K, S, hd]: new [B, L, K, hd] land at (row, :, slot)
            old_k, old_v = ck, cv
            ck = ck.at[rows, :, slots].set(k.astype(ck.dtype), mode="drop")
            cv = cv.at[rows, :, slots].set(v.astype(cv.dtype), mode="drop")
            if append:  # a ring's chunk: the ring as it was, then the chunk's own keys
                k, v = (
                    jnp.concatenate([o, jnp.swapaxes(n.astype(o.dtype), 1, 2)], axis=2)
                    for o, n in ((old_k, k), (old_v, v))
                )
            else:
                k, v = ck, cv
        else:
            S = ck.shape[1]
            k_new, v_new = (x.reshape(B, L, K * hd).astype(ck.dtype) for x in (k, v))
            layer_kv = [jax.lax.dynamic_index_in_dim(c, layer, 2, keepdims=False) for c in (ck, cv)]
            if append:
                k, v = (
                    jnp.concatenate([o, n], axis=1).reshape(B, S + L, K, hd)
                    for o, n in zip(layer_kv, (k_new, v_new), strict=True)
                )
            else:
                k, v = (
                    o.at[rows, slots].set(n, mode="drop").reshape(B, S, K, hd)
                    for o, n in zip(layer_kv, (k_new, v_new), strict=True)
                )
            ck, cv = k_new, v_new
        cache = (ck, cv, layer, slots, append)
    out = attention(
        q,
        k.astype(dt),
        v.astype(dt),
        mask,
        backend=backend,
        block=c.attention_block,
        kv_heads_major=cache is not None and cache[2] is None,
    )
    return _proj(c, out.reshape(B, L, H * hd), w, "o", lora), cache


@jax.custom_vjp
def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] (one dtype), with a hand-written backward.

    Same values as `_dot`; its backward forms the weight gradient x^T dy as one
    dot_general contracting the token axes of x and dy as they lie. JAX's own
    transpose of the einsum led XLA:CPU to copy dy transposed, [out, tokens],
    for an Eigen dot; this form lets XLA pick the layout (tests/models/test_layers.py:
    same gradients, fp32). Used for the attention's projections
    (`ModelConfig.proj_backward`).
    """
    return _linear_fwd(x, w)[0]


def _linear_fwd(x, w):
    return jnp.einsum("...i,io->...o", x, w), (x, w)


def _linear_bwd(res, dy):
    x, w = res
    toks = tuple(range(x.ndim - 1))
    dx = jnp.einsum("...o,io->...i", dy, w)
    return dx, jax.lax.dot_general(x, dy, ((toks, toks), ((), ())))


linear.defvjp(_linear_fwd, _linear_bwd)


def _swiglu_fwd(x, wg, wu, wd):
    g, u = _dot(x, wg, x.dtype), _dot(x, wu, x.dtype)
    return _dot(jax.nn.silu(g) * u, wd, x.dtype), (x, wg, wu, wd, g, u)


def _swiglu_bwd(res, dy):
    """Gradients of `swiglu`. Every weight gradient is one dot_general contracting
    the token axes of both operands as they lie ([..., in] with [..., out]), and
    d(gate), d(up) are formed once, in token-major layout, for both their uses.
    JAX's own transpose of the forward led XLA:CPU to build d(gate) and d(up) a
    second time, transposed [F, tokens], in copy fusions for the weight-gradient
    dots (the step's largest layout copies, docs/notes/
    2026-12-02-where-the-step-time-goes-profiles.md); this form has none of them."""
    x, wg, wu, wd, g, u = res
    toks = tuple(range(x.ndim - 1))
    tok_dot = functools.partial(jax.lax.dot_general, dimension_numbers=((toks, toks), ((), ())))
    s = jax.nn.sigmoid(g)
    a = g * s  # silu(g)
    dh = jnp.einsum("...d,fd->...f", dy, wd)  # dy @ wd^T
    du = dh * a
    dg = dh * u * s * (1 + g * (1 - s))  # silu'(g) = s (1 + g (1 - s))
    dx = jnp.einsum("...f,df->...d", dg, wg) + jnp.einsum("...f,df->...d", du, wu)
    return (
        dx,
        tok_dot(x, dg).astype(wg.dtype),
        tok_dot(x, du).astype(wu.dtype),
        tok_dot(a * u, dy).astype(wd.dtype),
    )


@jax.custom_vjp
def swiglu(x: jax.Array, wg: jax.Array, wu: jax.Array, wd: jax.Array) -> jax.Array:
    """down(silu(x @ wg) * (x @ wu)) with a hand-written backward (`_swiglu_bwd`).

    x [..., D]; wg, wu [D, F]; wd [F, D], all in one dtype (the compute dtype).
    Values and gradients equal the plain form up to fp32 summation order
    (tests/models/test_layers.py); it saves x, g = x @ wg, u = x @ wu for the backward,
    as autodiff does. Why: the MLP was 0.32-0.41 of the train step and its
    autodiff backward XLA:CPU's largest layout copies (`ModelConfig.mlp_backward`).
    """
    return _swiglu_fwd(x, wg, wu, wd)[0]


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


def mlp_apply(c: ModelConfig, w: dict, x: jax.Array, lora=None) -> jax.Array:
    """SwiGLU: down(silu(gate x) * up x). x [B, L, D]; w: the `mlp` params.
    `c.mlp_backward` "custom" differentiates through `swiglu`'s own VJP; an MLP
    with LoRA adapters runs the plain form with their deltas added (`_adapted`)."""
    wg, wu, wd = (w[k].astype(c.dtype) for k in ("gate_proj", "up_proj", "down_proj"))
    adapters = any(f"{n}_lora" in w for n in ("gate", "up", "down"))
    if c.mlp_backward == "custom" and not adapters:
        return swiglu(x.astype(c.dtype), wg, wu, wd)
    x = x.astype(c.dtype)
    g = _adapted(c, _dot(x, wg, c.dtype), x, w, "gate", lora)
    u = _adapted(c, _dot(x, wu, c.dtype), x, w, "up", lora)
    h = jax.nn.silu(g) * u
    return _adapted(c, _dot(h, wd, c.dtype), h, w, "down", lora)


def block_apply(
    c: ModelConfig, w: dict, x: jax.Array, rope, mask, backend: str, cache=None, lora=None
):
    """One pre-norm layer: x + attn(norm x), then + mlp(norm x). w: a Block's params
    (one layer); x [B, L, D] in the compute dtype; rope: `rope_cos_sin` tables,
    built once per forward for all layers; mask, backend, cache: as
    `attention_apply`'s; lora: None, or an adapter bank's (slot ids [B], scale [B]).
    Returns (x, cache)."""
    w = from_bits(c, w)
    h = rms_norm(w["input_layernorm"]["weight"], x, c.rms_eps, c.dtype)
    a, cache = attention_apply(c, w["self_attn"], h, rope, mask, backend, cache, lora)
    x = x + a
    h = rms_norm(w["post_attention_layernorm"]["weight"], x, c.rms_eps, c.dtype)
    return x + mlp_apply(c, w["mlp"], h, lora), cache


# ----------------------------------------------------------------------------- modules


class RMSNorm(nnx.Module):
    """Holds the norm weight [dim] ([stack, dim] when stacked), `INIT` at init (ones)."""

    INIT: ClassVar[Callable] = staticmethod(_ones)

    def __init__(self, dim: int, eps: float, dtype, param_dtype, stack: int | None = None):
        self.eps, self.dtype = eps, dtype
        self.weight = _param(None, self.INIT, (dim,), param_dtype, (None,), stack)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(self.weight[...], x, self.eps, self.dtype)


def _lora_init(key, shape, dtype):
    """A's init as PEFT's (Kaiming-uniform, a = sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / math.sqrt(shape[-2])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


class LoRAWeights(nnx.Module):
    """One projection's adapter: a [in, r] and b [r, out] (`nnx.LoRAParam`), b zero.
    With `c.lora.slots` = N both get a leading [N] axis and start at zero (a bank
    whose slots are written by `models.lora_bank`)."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs, n_in: int, n_out: int, names, stack):
        assert c.lora is not None
        r, pd, n = c.lora.rank, c.param_dtype, c.lora.slots
        bank = () if n is None else (n,)
        a_init = _zeros if n is not None else _lora_init
        a_names, b_names = (
            (*[None] * len(bank), names[0], None),
            (*[None] * len(bank), None, names[1]),
        )
        self.a = _param(rngs, a_init, (*bank, n_in, r), pd, a_names, stack, nnx.LoRAParam)
        self.b = _param(None, _zeros, (*bank, r, n_out), pd, b_names, stack, nnx.LoRAParam)


def _add_lora(module: nnx.Module, c: ModelConfig, rngs, shapes: dict, stack) -> None:
    """Adds `<name>_lora` adapters to `module` for the targets of `c.lora` among `shapes`
    ({name: (in, out, logical names)})."""
    if c.lora is None:
        return
    for name, (n_in, n_out, names) in shapes.items():
        if name in c.lora.targets:
            setattr(module, f"{name}_lora", LoRAWeights(c, rngs, n_in, n_out, names, stack))


class Attention(nnx.Module):
    """q/k/v/o projections ([in, out]), q/k/v biases (`attention_bias`), q/k norms
    (`qk_norm`; a family's `norm` module, default `RMSNorm`), LoRA adapters per config."""

    def __init__(
        self, c: ModelConfig, rngs: nnx.Rngs, stack: int | None = None, norm: type = RMSNorm
    ):
        init = nnx.initializers.normal(c.initializer_range)
        D, H, K, hd, pd = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.base_dtype
        shapes = {
            "q": (D, H * hd, ("embed", "heads")),
            "k": (D, K * hd, ("embed", "kv")),
            "v": (D, K * hd, ("embed", "kv")),
            "o": (H * hd, D, ("heads", "embed")),
        }
        for name, (n_in, n_out, names) in shapes.items():
            setattr(self, f"{name}_proj", _param(rngs, init, (n_in, n_out), pd, names, stack))
        if c.attention_bias:  # HF's q_proj.bias etc. (`hf_io`); zeros, as HF initialises them
            for name in "qkv":
                n_out, names = shapes[name][1:]
                setattr(self, f"{name}_bias", _param(None, _zeros, (n_out,), pd, names[1:], stack))
        if c.qk_norm:
            self.q_norm = norm(hd, c.rms_eps, c.dtype, pd, stack)
            self.k_norm = norm(hd, c.rms_eps, c.dtype, pd, stack)
        _add_lora(self, c, rngs, shapes, stack)


class MLP(nnx.Module):
    """gate/up [D, F] and down [F, D] projections (F: `width`, default the config's
    intermediate_size) and their LoRA adapters per config; with `experts` = E each
    has a leading [E] axis (logical axis "expert"; a MoE's experts, no adapters)."""

    def __init__(
        self,
        c: ModelConfig,
        rngs: nnx.Rngs,
        stack: int | None = None,
        width: int | None = None,
        experts: int | None = None,
    ):
        init = nnx.initializers.normal(c.initializer_range)
        D, pd = c.hidden_size, c.base_dtype
        F = c.intermediate_size if width is None else width
        lead, lead_names = ((), ()) if experts is None else ((experts,), ("expert",))
        shapes = {
            "gate": (D, F, ("embed", "mlp")),
            "up": (D, F, ("embed", "mlp")),
            "down": (F, D, ("mlp", "embed")),
        }
        for name, (n_in, n_out, names) in shapes.items():
            shape, axes = (*lead, n_in, n_out), (*lead_names, *names)
            setattr(self, f"{name}_proj", _param(rngs, init, shape, pd, axes, stack))
        if experts is None:
            _add_lora(self, c, rngs, shapes, stack)


class Block(nnx.Module):
    """One layer's params, or `stack` layers' params stacked on a leading axis; `mlp`:
    the MLP module (a MoE layer's: `moe_decoder.SparseMoE`)."""

    def __init__(self, c: ModelConfig, rngs: nnx.Rngs, stack: int | None = None, mlp=MLP):
        pd = c.base_dtype
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_eps, c.dtype, pd, stack)
        self.self_attn = Attention(c, rngs, stack)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_eps, c.dtype, pd, stack)
        self.mlp = mlp(c, rngs, stack)
