"""Logical axes (`models.axes`): one rules table maps the layers' logical names to mesh axes."""

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.models.axes import DEFAULT_RULES, LOGICAL_AXES, AxisRules, active_rules, axis_rules
from ac2_jax.training.core.sharding import make_mesh, param_shardings


def test_default_rules_put_weights_on_fsdp_and_tensor():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    rules = AxisRules()
    assert rules.spec(("embed", "heads"), mesh) == P("fsdp", "tensor")
    assert rules.spec(("vocab", "embed"), mesh) == P("tensor", "fsdp")
    assert rules.spec(("layers", "mlp", "embed"), mesh) == P(None, "tensor", "fsdp")
    assert rules.spec(("batch", "length"), mesh) == P(("data", "fsdp"), None)
    assert rules.spec(("expert", "embed"), mesh) == P(None, "fsdp")  # no 'expert' mesh axis
    assert {name for name, _ in DEFAULT_RULES} == set(LOGICAL_AXES)


def test_rules_take_precedence_in_order_and_use_each_mesh_axis_once():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    rules = AxisRules((("heads", ("tensor",)), ("mlp", ("tensor",)), ("mlp", ("fsdp",)),
                       ("embed", ("tensor",))))
    # embed's only rule wants tensor, which heads already took: replicated.
    assert rules.spec(("heads", "embed"), mesh) == P("tensor", None)
    assert rules.spec(("embed", "mlp"), mesh) == P("tensor", "fsdp")


def test_an_indivisible_dimension_is_an_error_or_a_counted_fallback():
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    with pytest.raises(ValueError, match=r"q_proj: dimension 1 \('heads', size 5\) does not "
                                         r"split over mesh axes \('tensor',\) \(2 ways\)") as e:
        AxisRules().fit(("embed", "heads"), (8, 5), mesh, "q_proj")
    assert "indivisible='replicate'" in str(e.value)  # says how to fix it
    spec, fallbacks = AxisRules(indivisible="replicate").fit(("embed", "vocab"), (8, 5), mesh,
                                                             "lm_head")
    assert spec == P("fsdp", None) and [(f.logical, f.size, f.ways) for f in fallbacks] == [
        ("vocab", 5, 2)]


def test_bad_rules_and_mesh_names_are_refused():
    with pytest.raises(ValueError, match="unknown logical axes \\['hidden'\\]"):
        AxisRules((("hidden", ("fsdp",)),))
    with pytest.raises(ValueError, match="indivisible"):
        AxisRules(indivisible="drop")
    with pytest.raises(ValueError, match="not a logical axis"):
        AxisRules().spec(("tensor",), make_mesh())  # a mesh axis where a logical one belongs


def test_the_decoder_is_annotated_with_logical_axes_and_sharded_by_the_rules():
    model = Decoder(DecoderConfig.tiny(vocab_size=64, tie_embeddings=False), rngs=nnx.Rngs(0))
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    assert specs["embed_tokens"].get_value() == P("vocab", "embed")
    assert specs["lm_head"].get_value() == P("embed", "vocab")
    assert specs["layers"][0]["self_attn"]["k_proj"].get_value() == P("embed", "kv")
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (forced host) devices")
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    tensor_on_vocab_only = AxisRules((("embed", ("fsdp",)), ("vocab", ("tensor",))))
    sh = param_shardings(nnx.state(model, nnx.Param), mesh, tensor_on_vocab_only)
    assert sh["layers"][0]["mlp"]["up_proj"].get_value().spec == P("fsdp", None)
    assert sh["embed_tokens"].get_value().spec == P("tensor", "fsdp")
    with jax.set_mesh(make_mesh(data=2, fsdp=2, tensor=2)), axis_rules(tensor_on_vocab_only):
        assert active_rules() is tensor_on_vocab_only
        eager = Decoder(DecoderConfig.tiny(vocab_size=64), rngs=nnx.Rngs(0))
        assert eager.layers[0].mlp.up_proj[...].sharding.spec == P("fsdp", None)
    assert active_rules() == AxisRules()
