"""models.layers' pure pieces: RoPE tables built once per forward (`rope_cos_sin` +
`rotate`) equal HF's rotate-half RoPE computed per call (fp32; atol 1e-5 against a
numpy reference, 1e-6 against per-call `apply_rope`), and the SwiGLU MLP's custom VJP
(`swiglu`) and the projections' (`linear`) equal autodiff (fp32, 1e-5 relative),
the MLP's without autodiff's transposed d(gate) / d(up) copies."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ac2_jax.models import DecoderConfig
from ac2_jax.models.layers import apply_rope, linear, mlp_apply, rope_cos_sin, rope_inv_freq, rotate


def _rope_reference(x, positions, inv_freq):
    """HF's apply_rotary_pos_emb in numpy: angles in fp32 as HF forms them, the
    rotation in float64. x [B, L, H, hd], positions [B, L]."""
    x = np.asarray(x, np.float64)
    freqs = (np.asarray(positions, np.float32)[..., None]
             * np.asarray(inv_freq, np.float32)).astype(np.float64)
    emb = np.concatenate([freqs, freqs], -1)[:, :, None]
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def test_shared_rope_tables_equal_per_call_rope():
    c = DecoderConfig.tiny(head_dim=16, rope_theta=10000.0)
    inv = jnp.asarray(rope_inv_freq(c))
    rng = np.random.default_rng(0)
    pos = jnp.asarray(rng.integers(0, 300, (2, 7)), jnp.int32)
    tables = rope_cos_sin(pos, inv)
    assert tables[0].shape == tables[1].shape == (2, 7, 1, 16)
    for heads in (4, 2):  # q and k share one table (broadcast over heads)
        x = jnp.asarray(rng.normal(size=(2, 7, heads, 16)), jnp.float32)
        want = _rope_reference(x, pos, inv)
        np.testing.assert_allclose(rotate(x, tables), want, atol=1e-5, rtol=0)
        np.testing.assert_allclose(rotate(x, tables), apply_rope(x, pos, inv), atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- SwiGLU's VJP

def _mlp_weights(D, F, seed=0):
    rng = np.random.default_rng(seed)
    return {"gate_proj": jnp.asarray(rng.standard_normal((D, F), np.float32) * 0.3),
            "up_proj": jnp.asarray(rng.standard_normal((D, F), np.float32) * 0.3),
            "down_proj": jnp.asarray(rng.standard_normal((F, D), np.float32) * 0.3)}


@pytest.mark.parametrize("x_shape", [(2, 7, 16), (9, 16)])
def test_swiglu_custom_vjp_equals_autodiff(x_shape):
    """`mlp_backward="custom"` (swiglu's hand-written VJP) gives the values and the
    gradients of x and all three weights of JAX's autodiff, fp32, to 1e-5 relative
    (summation order only), for [B, L, D] and [T, D] inputs, under jit and grad."""
    D, F = 16, 48
    w = _mlp_weights(D, F)
    x = jnp.asarray(np.random.default_rng(1).standard_normal(x_shape, np.float32))
    dy = jnp.asarray(np.random.default_rng(2).standard_normal(x_shape, np.float32))
    outs = {}
    for mode in ("autodiff", "custom"):
        c = DecoderConfig.tiny(hidden_size=D, intermediate_size=F, mlp_backward=mode)
        y, vjp = jax.vjp(lambda w, x, c=c: mlp_apply(c, w, x), w, x)
        outs[mode] = (y, *jax.jit(vjp)(dy))
    (ya, gwa, gxa), (yc, gwc, gxc) = outs["autodiff"], outs["custom"]
    for got, want in [(yc, ya), (gxc, gxa)] + [(gwc[k], gwa[k]) for k in gwa]:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                                   rtol=1e-5, atol=1e-5 * float(np.max(np.abs(want))))


def _transposed_token_arrays(mode, D=256, F=512, B=4, L=256):
    """How many arrays of the compiled MLP fwd+bwd are [F, tokens]: token-minor copies."""
    c = DecoderConfig.tiny(hidden_size=D, intermediate_size=F, mlp_backward=mode)
    w = _mlp_weights(D, F)
    x = jnp.zeros((B, L, D), jnp.float32)
    f = jax.jit(jax.grad(lambda w, x: jnp.sum(mlp_apply(c, w, x) ** 2), argnums=(0, 1)))
    text = f.lower(w, x).compile().as_text()
    entry = text[text.index("ENTRY"):]
    return len(re.findall(rf"^\s*%\S+ = f32\[{F},{B * L}\]", entry, re.M))


def test_swiglu_custom_vjp_drops_the_transposed_dgate_copies():
    """The finding behind `mlp_backward="custom"`, at the small train step's MLP shape
    (1,024 tokens, D 256, F 512): under autodiff XLA:CPU builds d(gate) and d(up) a
    second time transposed, [F, tokens] (two copy fusions); the custom VJP leaves at
    most one [F, tokens] array (XLA may still lay the forward's silu(g) * u out
    token-minor for the down-projection's weight gradient). Compile only, no run."""
    assert _transposed_token_arrays("autodiff") == 2
    assert _transposed_token_arrays("custom") <= 1


@pytest.mark.parametrize("x_shape", [(2, 7, 16), (9, 16)])
def test_linear_custom_vjp_equals_autodiff(x_shape):
    """`linear` (the projections' custom VJP, `proj_backward="custom"`): values and
    gradients of x and w equal the plain einsum's under autodiff, fp32, 1e-5 relative."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal(x_shape, np.float32))
    w = jnp.asarray(rng.standard_normal((16, 24), np.float32))
    dy = jnp.asarray(rng.standard_normal(x_shape[:-1] + (24,), np.float32))
    plain = jax.vjp(lambda x, w: jnp.einsum("...i,io->...o", x, w), x, w)
    custom = jax.vjp(linear, x, w)
    for got, want in zip((custom[0], *jax.jit(custom[1])(dy)), (plain[0], *plain[1](dy))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want),
                                   rtol=1e-5, atol=1e-5 * float(np.max(np.abs(want))))


def _lora_model(layers: int, base_dtype, seed=0):
    from flax import nnx

    from ac2_jax.models import Decoder
    from ac2_jax.models.lora import LoRAConfig

    c = DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=256, num_layers=layers,
                      num_heads=4, num_kv_heads=2, head_dim=16, scan_layers=True, remat="full",
                      lora=LoRAConfig(rank=4, alpha=8, base_dtype=base_dtype))
    return Decoder(c, rngs=nnx.Rngs(seed))


# The two frozen-bf16 tests' tokens: the same program (3 bf16 layers, these tokens
# baked in) is compiled once for both (the run's persistent cache).
LORA_TOKENS = np.random.default_rng(2).integers(0, 128, (1, 24)).astype(np.int32)


def _adapter_grads(model, tokens):
    from flax import nnx

    graphdef, lora, rest = nnx.split(model, nnx.LoRAParam, ...)
    L = tokens.shape[1]
    pos, seg = jnp.arange(L)[None], jnp.ones((1, L), jnp.int32)

    def f(lora, rest):
        return (nnx.merge(graphdef, lora, rest)(tokens, pos, seg) ** 2).mean()

    return jax.jit(jax.grad(f)), lora, rest


def test_frozen_bf16_base_travels_the_layer_scan_as_bits_with_equal_gradients():
    """`layer_params` passes a LoRA model's frozen bf16 base weights through the layer
    scan as uint16 bits (`from_bits` turns them back per layer): the adapters'
    gradients equal those of the same model with those weights held in fp32 (fp32
    compute both; 1e-5 relative to each gradient's largest entry: XLA fuses
    the two differently), and no uint16 reaches the layers' math."""
    from flax import nnx

    from ac2_jax.models.layers import layer_params

    half, full = _lora_model(3, "bfloat16"), _lora_model(3, None)
    for m in (half, full):  # non-zero B: every adapter has a gradient through the base
        rng = np.random.default_rng(1)
        for _path, v in nnx.to_flat_state(nnx.state(m, nnx.LoRAParam)):
            v.set_value(jnp.asarray(rng.normal(size=v.shape, scale=0.1), v.dtype))
    bits = layer_params(half.config, half.layers)
    assert bits["mlp"]["gate_proj"].dtype == jnp.uint16
    assert bits["mlp"]["gate_lora"]["a"].dtype == jnp.float32  # adapters never as bits
    hb, hf = nnx.state(half, nnx.Param), nnx.state(full, nnx.Param)
    for (_path, a), (_, b) in zip(nnx.to_flat_state(hb), nnx.to_flat_state(hf), strict=True):
        if a.get_value().dtype == jnp.bfloat16:
            b.set_value(a.get_value().astype(jnp.float32))
    tokens = jnp.asarray(LORA_TOKENS)
    grads = [fn(lora, rest) for fn, lora, rest in
             (_adapter_grads(m, tokens) for m in (half, full))]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1]), strict=True):
        assert float(jnp.abs(b).max()) > 0
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.abs(b).max()))


def test_frozen_bf16_base_costs_no_fp32_copy_of_every_layer():
    """XLA:CPU slices no bf16 array: a bf16 stack scanned as it is becomes a slice of
    an fp32 copy of the whole stack, hoisted out of the loop (docs/notes/
    2026-12-05-lora-frozen-bf16-base.md). With the bits the step's temporaries grow by less than
    0.75x an fp32 copy of a layer's base weights per added layer."""
    from flax import nnx

    def temp(layers):  # 3 layers: the previous test's program, read back from the cache
        fn, lora, rest = _adapter_grads(_lora_model(layers, "bfloat16"), jnp.asarray(LORA_TOKENS))
        return fn.lower(lora, rest).compile().memory_analysis().temp_size_in_bytes

    model = nnx.eval_shape(lambda: _lora_model(1, None))
    layer = sum(x.size for x in jax.tree.leaves(nnx.state(model.layers, nnx.Param)))
    lora = sum(x.size for x in jax.tree.leaves(nnx.state(model.layers, nnx.LoRAParam)))
    fp32_layer = 4 * (layer - lora)
    per_layer = (temp(7) - temp(3)) / 4
    assert per_layer < 0.75 * fp32_layer, (per_layer, fp32_layer)
