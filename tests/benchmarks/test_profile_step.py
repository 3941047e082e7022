"""benchmarks/profile_step at toy size: thunk time from a real jax.profiler trace is
attributed to the source that produced it (the compiled HLO's stack frames)."""

from __future__ import annotations

import json

import pytest

from benchmarks import profile_step


def test_tiny_train_step_profile_attributes_time_by_source(tmp_path):
    out = tmp_path / "profile.json"
    res = profile_step.main(["--what", "train", "--sizes", "tiny", "--steps", "1",
                             "--out", str(out)])["tiny"]
    cats = res["by_category"]
    # The decoder's parts and the optimizer each show up under their own name...
    for name in ("attention", "mlp", "qkv/out projections", "lm head", "optimizer"):
        assert cats.get(name, 0.0) > 0.0, (name, cats)
    # ...and nearly all thunk time is attributed (not "other").
    assert cats.get("other", 0.0) < 0.2 * sum(cats.values()), cats
    assert set(res["by_direction"]) == {"forward", "backward"}
    assert abs(sum(res["by_kind"].values()) - res["thunk_ms"]) < 1e-6 * res["thunk_ms"] + 1e-9
    assert json.loads(out.read_text())["benchmark"] == "profile_train"


def test_tiny_decode_profile_is_forward_only():
    res = profile_step.main(["--what", "decode", "--sizes", "tiny", "--steps", "1",
                             "--batch", "2"])["tiny"]
    assert set(res["by_direction"]) == {"forward"}
    assert res["by_category"].get("attention", 0.0) > 0.0
    assert res["tokens"] == 2 * 16
    # The decode loop's `while` thunk spans its body's thunks: it is not counted
    # again (it was, and was the top "thunk", inflating "other").
    assert not [t for t in res["top_thunks"] if t[0].startswith("while")], res["top_thunks"]
    assert res["by_category"].get("other", 0.0) < 0.2 * res["thunk_ms"], res["by_category"]


def test_train_profile_takes_runtime_choices():
    """--model_config reaches the profiled step's DecoderConfig (a bad value is refused
    by the config itself), and a field that is not a runtime choice is refused."""
    with pytest.raises(ValueError, match="mlp_backward must be one of"):
        profile_step.main(["--sizes", "tiny", "--model_config", "mlp_backward=fast"])
    with pytest.raises(SystemExit, match="not a runtime field"):
        profile_step.main(["--sizes", "tiny", "--model_config", "vocab_size=8"])
