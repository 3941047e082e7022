"""bench_step_ab at toy size: both variants compile and run the same step (the
custom VJPs change how gradients are formed, not the loss: fp32, 1e-6), and a
choice that is not a runtime field is refused with the fields named."""

import json

import numpy as np
import pytest

from benchmarks.bench_step_ab import main, parse_choices


def test_autodiff_and_custom_vjps_run_the_same_step(tmp_path):
    (row,) = main(["--sizes", "tiny", "--rounds", "1", "--out", str(tmp_path / "ab.json"),
                   "--a", "mlp_backward=autodiff,proj_backward=autodiff",
                   "--b", "mlp_backward=custom,proj_backward=custom"])
    np.testing.assert_allclose(row["loss_b"], row["loss_a"], rtol=1e-6)
    assert row["a"] == {"mlp_backward": "autodiff", "proj_backward": "autodiff"}
    assert row["a_min_s"] > 0 and row["b_min_s"] > 0
    assert row["ratio_min"] == pytest.approx(row["b_min_s"] / row["a_min_s"])
    assert json.loads((tmp_path / "ab.json").read_text())["rows"] == [row]


def test_parse_choices():
    assert parse_choices("scan_layers=true,attention_block=64") == {
        "scan_layers": True, "attention_block": 64}
    with pytest.raises(SystemExit, match="not a runtime field"):
        parse_choices("hidden_size=8")
    with pytest.raises(SystemExit, match="field=value"):
        parse_choices("mlp_backward")
