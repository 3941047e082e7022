"""curves: metrics from JSONL / records / dicts, the plotted data, PNG output, errors."""

import io
import json

import matplotlib.image
import numpy as np
import pytest

from ac2_jax.viz import curves_figure, load_metrics, plot_curves


def _write_log(path):
    recs = [{"step": 0, "loss": 2.0, "target": 0.1},
            {"step": 10, "loss": 1.5, "target": 0.3, "retention": 0.9, "tag": "x"},
            {"step": 20, "loss": 1.0, "retention": 0.85, "flag": True},
            {"step": 30, "loss": float("nan"), "target": 0.6, "retention": 0.8}]
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n", encoding="utf-8")
    return recs


def test_load_metrics_from_jsonl_records_and_dicts(tmp_path):
    recs = _write_log(tmp_path / "m.jsonl")
    series = load_metrics(tmp_path / "m.jsonl")
    assert sorted(series) == ["loss", "retention", "target"]  # strings / bools skipped
    np.testing.assert_array_equal(series["loss"][0], [0, 10, 20])  # NaN skipped
    np.testing.assert_array_equal(series["loss"][1], [2.0, 1.5, 1.0])
    np.testing.assert_array_equal(series["target"][0], [0, 10, 30])
    np.testing.assert_array_equal(series["retention"][1], [0.9, 0.85, 0.8])
    assert load_metrics(recs).keys() == series.keys()
    no_step = load_metrics([{"a": 1.0}, {"a": 3.0}])
    np.testing.assert_array_equal(no_step["a"][0], [0, 1])
    d = load_metrics({"a": [1.0, 2.0, 4.0], "b": [[5, 0.5], [7, 0.25]]})
    np.testing.assert_array_equal(d["a"][0], [0, 1, 2])
    np.testing.assert_array_equal(d["b"][0], [5, 7])
    np.testing.assert_array_equal(d["b"][1], [0.5, 0.25])


def test_plot_curves_data_and_png(tmp_path):
    _write_log(tmp_path / "m.jsonl")
    fig = curves_figure(tmp_path / "m.jsonl", keys=["target", "loss"], labels=["target metric", "loss"])
    axes = fig.get_axes()
    assert len(axes) == 2
    np.testing.assert_array_equal(axes[0].lines[0].get_xdata(), [0, 10, 30])
    np.testing.assert_array_equal(axes[0].lines[0].get_ydata(), [0.1, 0.3, 0.6])
    np.testing.assert_array_equal(axes[1].lines[0].get_ydata(), [2.0, 1.5, 1.0])
    assert "target metric" in axes[0].get_title()
    out = tmp_path / "plots" / "curves.png"
    data = plot_curves(tmp_path / "m.jsonl", out)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and out.read_bytes() == data
    img = matplotlib.image.imread(io.BytesIO(data), format="png")
    assert img.shape[0] > 100 and img.shape[1] > 300  # three panels side by side
    assert len(curves_figure(tmp_path / "m.jsonl").get_axes()) == 3


def test_errors_name_the_problem(tmp_path):
    _write_log(tmp_path / "m.jsonl")
    with pytest.raises(KeyError, match="accuracy"):
        plot_curves(tmp_path / "m.jsonl", keys=["accuracy"])
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_metrics(tmp_path / "nope.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"loss": 1}\n{oops\n', encoding="utf-8")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_metrics(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="labels"):
        curves_figure({"a": [1, 2]}, keys=["a"], labels=["x", "y"])
    with pytest.raises(ValueError, match="shape"):
        load_metrics({"a": [[1, 2, 3]]})
