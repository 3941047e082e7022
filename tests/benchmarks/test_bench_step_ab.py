"""bench_step_ab at toy size: both variants compile and run the same step (the
custom VJPs change how gradients are formed, not the loss: fp32, 1e-6; so do XLA
options given to one side's compile), and a choice that is not a runtime field,
or an option that is not name=value, is refused with what to write."""

import json

import numpy as np
import pytest

from benchmarks.bench_step_ab import main, parse_choices, parse_xla_options


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


def test_xla_options_of_one_side(tmp_path):
    (row,) = main(["--sizes", "tiny", "--rounds", "1", "--a", "", "--b", "",
                   "--xla_b", "xla_cpu_use_onednn=true,xla_cpu_prefer_vector_width=512"])
    assert row["xla_a"] == {} and row["xla_b"] == {"xla_cpu_use_onednn": True,
                                                   "xla_cpu_prefer_vector_width": 512}
    np.testing.assert_allclose(row["loss_b"], row["loss_a"], rtol=1e-6)


def test_parse_xla_options():
    assert parse_xla_options(
        "xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_DEFAULT,xla_cpu_enable_fast_math=false") == {
        "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_DEFAULT", "xla_cpu_enable_fast_math": False}
    assert parse_xla_options("") == {}
    assert parse_xla_options("xla_cpu_experimental_ynn_fusion_type=A,B,xla_cpu_ftz=true") == {
        "xla_cpu_experimental_ynn_fusion_type": "A,B", "xla_cpu_ftz": True}
    with pytest.raises(SystemExit, match="xla_name=value"):
        parse_xla_options("use_onednn=true")
    with pytest.raises(SystemExit, match="xla_name=value"):
        parse_xla_options("xla_cpu_use_onednn")
