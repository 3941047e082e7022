"""The transformer skeleton's contract with a family (`models.skeleton`) and the config
base's (`models.config.ModelConfig`): what a family or a caller gets wrong is refused
in one line, never run as a different model."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.models.gemma3 import Gemma3, Gemma3Config
from ac2_jax.models.gemma3_config import FULL, SLIDING
from ac2_jax.models.io.hf_io import hf_state_dict, save_hf_checkpoint
from ac2_jax.models.lora import LoRAConfig
from ac2_jax.models.moe import MoEDecoderConfig
from ac2_jax.models.moe_decoder import MoEDecoder
from ac2_jax.models.qwen3_moe import Qwen3MoeFamily
from ac2_jax.training import OptimizerConfig
from ac2_jax.training.core import create_train_state


def test_fields_past_head_dim_are_keyword_only_in_every_family_config():
    """Gemma3Config's own fields follow ModelConfig's: a ninth positional argument
    (once `layer_types`) would land in another field; it is refused instead."""
    with pytest.raises(TypeError, match="positional"):
        Gemma3Config(64, 32, 64, 2, 4, 2, 8, (SLIDING, FULL))
    with pytest.raises(TypeError, match="positional"):
        DecoderConfig(64, 32, 64, 2, 4, 2, 8, True)
    c = Gemma3Config(64, 32, 64, 2, 4, 2, 8, layer_types=(SLIDING, FULL), sliding_window=4)
    assert c.layer_types == (SLIDING, FULL) and c.sliding_window == 4 and c.qk_norm is True
    with pytest.raises(ValueError, match="qk_norm=True"):
        Gemma3Config.tiny(qk_norm=(SLIDING, FULL))  # truthy, and still refused


class _WindowSecond(Gemma3):
    """Gemma 3 with its kinds listed full first, sliding second."""

    def attention_kinds(self):
        return tuple(reversed(super().attention_kinds()))

    def layer_kind(self, i):
        return 1 - super().layer_kind(i)


def test_a_family_whose_second_attention_kind_has_a_window_is_refused():
    """Under the layer scan, blocked kernels run kind 1 on kind 0's mask without its
    window: a window on kind 1 would be dropped (max |logit diff| 3.4 in a probe), so
    the skeleton refuses it, naming the fix."""
    config = Gemma3Config.tiny(vocab_size=32, num_layers=2, layer_types=(SLIDING, FULL),
                               sliding_window=3)
    model = _WindowSecond(config, rngs=nnx.Rngs(0))
    tokens = np.zeros((1, 8), np.int32)
    with pytest.raises(ValueError, match="only the first with a window.*windowed kind first"):
        model(tokens, np.arange(8, dtype=np.int32)[None], np.ones_like(tokens))


def test_a_flat_token_array_is_refused_naming_the_family():
    config = Gemma3Config.tiny(vocab_size=32, num_layers=2, layer_types=(SLIDING, FULL))
    model = Gemma3(config, rngs=nnx.Rngs(0))
    tokens = np.zeros((8,), np.int32)
    with pytest.raises(ValueError, match=r"Gemma3: tokens must be \[batch, length\]"):
        model(tokens, np.arange(8, dtype=np.int32), np.ones_like(tokens))


def test_a_misspelt_keyword_is_refused_naming_it():
    """Family inputs travel as keywords (MoE's `routing`): one this family does not take
    is an error naming it, never ignored."""
    model = Gemma3(Gemma3Config.tiny(vocab_size=32, num_layers=2,
                                     layer_types=(SLIDING, FULL)), rngs=nnx.Rngs(0))
    tokens = np.zeros((1, 8), np.int32)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['adapter_id'\]"):
        model(tokens, np.arange(8, dtype=np.int32)[None], np.ones_like(tokens), adapter_id=1)


def test_a_position_past_the_cache_is_refused_not_dropped():
    """A token at position >= the cache's max_len had no slot: its write was dropped and
    the step ran on as if it were there. Concrete positions past the cache are refused,
    naming the fix; in range (and -1 padding) they run."""
    config = Gemma3Config.tiny(vocab_size=32, num_layers=2, layer_types=(SLIDING, FULL),
                               sliding_window=2)
    model = Gemma3(config, rngs=nnx.Rngs(0))
    cache = model.init_cache(1, 4)  # the sliding layer's cache is a ring of 2 slots
    tokens = np.zeros((1, 1), np.int32)
    logits, _ = model.decode(tokens, np.array([[3]], np.int32), cache)
    assert logits.shape == (1, 1, 32)
    model.decode(tokens, np.array([[-1]], np.int32), cache)  # padding writes nothing
    with pytest.raises(ValueError, match=r"Gemma3.decode: position 4 is past the cache, "
                                         r"which holds positions 0..3; .*init_cache"):
        model.decode(tokens, np.array([[4]], np.int32), cache)
    # traced positions cannot be checked: the jitted caller keeps them in range
    step = nnx.jit(lambda m, t, p, c: m.decode(t, p, c)[0])
    assert step(model, tokens, np.array([[3]], np.int32), cache).shape == (1, 1, 32)


class _Blocks(Decoder):
    """The dense decoder with its one param stack named `blocks` (not `layers`)."""

    STACKS = ("blocks",)

    def layer_stack(self, i):
        return "blocks"


def test_a_renamed_stack_holds_its_frozen_weights_as_bits():
    """A LoRA model's frozen 16-bit layer weights sit in a train state as uint16 bits
    (`frozen_bits`); the stacks are read from the model (`STACKS`), so a family whose
    stack has another name gets them too (was a fixed list: silently skipped)."""
    lora = LoRAConfig(rank=2, base_dtype="bfloat16")
    config = DecoderConfig.tiny(
        vocab_size=32, num_layers=1, scan_layers=True, remat="none", lora=lora
    )
    model = _Blocks(config, rngs=nnx.Rngs(0))
    graphdef, state = create_train_state(model, OptimizerConfig(learning_rate=1e-3))
    dtypes = {
        ".".join(map(str, k)): v.dtype
        for k, v in nnx.to_flat_state(state.rest)
        if k[0] == "blocks" and not any(str(p).endswith("_lora") for p in k)
    }
    assert dtypes and set(dtypes.values()) == {np.dtype(np.uint16)}, dtypes
    back = state.model(graphdef)  # and back in bf16, the same weights
    assert back.blocks.self_attn.q_proj[...].dtype == jnp.bfloat16
    want, got = nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(back))
    for (path, a), (_, b) in zip(want, got, strict=True):
        assert a.dtype == b.dtype, path
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))


class _DenseBlocks(MoEDecoder):
    """The MoE decoder with its dense layers' stack named `dense_blocks`."""

    STACKS = ("layers", "dense_blocks")

    def layer_stack(self, i):
        return "layers" if i in self.config.moe_layers else "dense_blocks"


class _DenseBlocksFamily(Qwen3MoeFamily):
    def build(self, config, rngs):
        return _DenseBlocks(config, rngs=rngs)


def test_hf_io_reads_the_stacks_of_the_family_model(tmp_path):
    """HF stacking reads the model's `STACKS` and `layer_stack` (was a fixed list: a
    renamed stack was written under its own name and never read)."""
    config = MoEDecoderConfig.tiny(vocab_size=32, scan_layers=True, remat="none")
    plain = MoEDecoder(config, rngs=nnx.Rngs(0))
    renamed = _DenseBlocks(config, rngs=nnx.Rngs(0))
    want = hf_state_dict(plain)
    got = hf_state_dict(renamed)
    assert sorted(got) == sorted(want)
    for name, arr in want.items():
        np.testing.assert_array_equal(got[name], arr, err_msg=name)
    save_hf_checkpoint(plain, str(tmp_path))
    back = _DenseBlocksFamily().load_hf_weights(config, str(tmp_path))
    assert isinstance(back, _DenseBlocks)
    for name, arr in hf_state_dict(back).items():
        np.testing.assert_array_equal(arr, want[name], err_msg=name)


def test_row_inputs_of_the_wrong_shape_are_refused_naming_them():
    """subtree_end is [batch, length] like tokens; adapter_ids and logits_at are [batch]:
    another shape is a one-line error naming the model and the array (was broadcast
    or failed deep inside)."""
    lora = LoRAConfig(rank=2, slots=2)
    model = Decoder(DecoderConfig.tiny(vocab_size=32, num_layers=1, lora=lora), rngs=nnx.Rngs(0))
    tokens = np.zeros((2, 4), np.int32)
    positions = np.tile(np.arange(4, dtype=np.int32), (2, 1))
    with pytest.raises(ValueError, match=r"Decoder: subtree_end must be \[batch, length\]"):
        model(tokens, positions, tokens + 1, subtree_end=np.full((4,), 4, np.int32))
    with pytest.raises(ValueError, match=r"Decoder: adapter_ids must be \[batch\] = \[2\], got"):
        model(tokens, positions, tokens + 1, adapter_ids=np.zeros((2, 1), np.int32))
    cache = model.init_cache(2, 8)
    with pytest.raises(ValueError, match=r"Decoder: logits_at must be \[batch\] = \[2\], got"):
        model.decode(tokens, positions, cache, logits_at=np.zeros((1,), np.int32))
    with pytest.raises(ValueError, match=r"Decoder: adapter_ids must be \[batch\] = \[2\], got"):
        model.decode(tokens, positions, cache, adapter_ids=np.zeros((3,), np.int32))


class _NoSuchKind(Decoder):
    def layer_kind(self, i):
        return 1  # the decoder has one attention kind: 0


class _NoSuchStack(Decoder):
    def layer_stack(self, i):
        return "blocks"  # not in STACKS


def test_a_layer_kind_or_stack_the_family_does_not_have_is_refused():
    config = DecoderConfig.tiny(vocab_size=32, num_layers=2)
    with pytest.raises(ValueError, match=r"_NoSuchKind.layer_kind\(0\) is 1; .* 1 kind"):
        _NoSuchKind(config, rngs=nnx.Rngs(0)).init_cache(1, 4)
    with pytest.raises(ValueError, match=r"_NoSuchStack.layer_stack\(0\) is 'blocks', not one "
                                         r"of its STACKS \('layers',\)"):
        _NoSuchStack(config, rngs=nnx.Rngs(0))
