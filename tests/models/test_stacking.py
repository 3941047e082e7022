"""Layer layouts: stacking and unstacking pure param dicts is exact and reversible;
the wrong direction and gappy layer keys are errors."""

import numpy as np
import pytest

from ac2_jax.models import stack_layers, to_layout, unstack_layers
from ac2_jax.models.stacking import is_stacked


def per_layer(n=3):
    rng = np.random.default_rng(0)
    f32 = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    layers = {i: {"mlp": {"up_proj": f32(4, 6)}, "input_layernorm": {"weight": f32(4)}}
              for i in range(n)}
    return {"embed_tokens": f32(10, 4), "layers": layers}


def test_round_trip_is_exact_and_keeps_other_entries():
    params = per_layer()
    stacked = stack_layers(params)
    assert is_stacked(stacked) and not is_stacked(params)
    assert stacked["layers"]["mlp"]["up_proj"].shape == (3, 4, 6)
    np.testing.assert_array_equal(stacked["layers"]["mlp"]["up_proj"][2],
                                  params["layers"][2]["mlp"]["up_proj"])
    assert stacked["embed_tokens"] is params["embed_tokens"]
    back = unstack_layers(stacked)
    assert sorted(back["layers"]) == [0, 1, 2]
    for i in range(3):
        np.testing.assert_array_equal(back["layers"][i]["input_layernorm"]["weight"],
                                      params["layers"][i]["input_layernorm"]["weight"])
    assert to_layout(params, stacked=False) is params  # already so: unchanged
    on_disk = {**params, "layers": {str(i): v for i, v in params["layers"].items()}}
    np.testing.assert_array_equal(stack_layers(on_disk)["layers"]["mlp"]["up_proj"],
                                  stacked["layers"]["mlp"]["up_proj"])  # str keys (Orbax)


def test_errors():
    params = per_layer()
    with pytest.raises(ValueError, match="stacked already"):
        stack_layers(stack_layers(params))
    with pytest.raises(ValueError, match="per-layer already"):
        unstack_layers(params)
    gappy = {**params, "layers": {0: params["layers"][0], 2: params["layers"][2]}}
    with pytest.raises(ValueError, match="0..n-1"):
        stack_layers(gappy)
