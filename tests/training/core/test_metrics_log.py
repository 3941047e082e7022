"""Metrics sinks (ac2_jax.training.core.metrics_log): prefixed keys in the JSONL and in
TensorBoard, and non-numeric values counted, never silently lost; console lines fit 120
characters and say why a step had no signal; the optional W&B sink."""

import io
import math
import os
import struct
import sys

import pytest

from ac2_jax.extras import MissingExtraError
from ac2_jax.training.core import MetricsLogger, read_metrics
from ac2_jax.training.core.metrics_log import CONSOLE_WIDTH, console_line


def test_prefixes_and_dropped_values_are_counted(tmp_path):
    log = MetricsLogger(str(tmp_path), tensorboard=True, console=False)
    log.log(1, {"loss": 2.5, "note": "text", "bad": math.nan}, prefix="train")
    log.log(1, {"accuracy": 0.75}, prefix="eval")
    log.log(2, {"loss": 1.5, "note": "again"}, prefix="train")
    log.log(3, {"raw": 1})
    log.close()
    rows = read_metrics(log.path)
    assert [{k: v for k, v in r.items() if k != "time"} for r in rows] == [
        {"step": 1, "train/loss": 2.5}, {"step": 1, "eval/accuracy": 0.75},
        {"step": 2, "train/loss": 1.5}, {"step": 3, "raw": 1.0}]
    assert log.dropped == {"train/note": 2, "train/bad": 1}
    events = os.listdir(tmp_path / "tensorboard")
    assert len(events) == 1 and events[0].startswith("events.out.tfevents")
    scalars = {}
    for event in _events(tmp_path / "tensorboard" / events[0]):
        for v in event.summary.value:
            scalars.setdefault(v.tag, []).append((event.step, v.simple_value))
    assert sorted(scalars) == ["eval/accuracy", "raw", "train/loss"]
    assert scalars["train/loss"] == [(1, 2.5), (2, 1.5)]


def _events(path):
    """The Event protos of a TensorBoard file (TFRecord: u64 length, u32 crc, data, u32 crc)."""
    from tensorboardX.proto.event_pb2 import Event

    data, i = path.read_bytes(), 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        yield Event.FromString(data[i + 12:i + 12 + n])
        i += 12 + n + 4


def _console_of(log, width=400):
    """Points the logger's console at a buffer (wide: rich itself never wraps it)."""
    from rich.console import Console

    buffer = io.StringIO()
    log._console = Console(file=buffer, width=width, color_system=None)
    return buffer


def test_console_lines_never_exceed_120_characters(tmp_path):
    log = MetricsLogger(str(tmp_path), tensorboard=False, console=True)
    out = _console_of(log)
    keys = [f"metric_with_a_rather_long_name_{i}" for i in range(8)]
    metrics = {k: 1234.5678 + i for i, k in enumerate(keys)} | {"other": 1.0}
    log.log(12, metrics, prefix="train", keys=keys)
    log.log(13, {"loss": 0.5, "entropy": 2.0}, prefix="train")
    (long, short) = out.getvalue().splitlines()
    assert len(long) <= CONSOLE_WIDTH
    shown = [part.split("=")[0] for part in long.split("  ")[1:]]
    # The lowest-priority keys (the end of `keys`) go first; the rest keep their order.
    assert shown == [f"train/{k}" for k in keys[:len(shown)]] and 0 < len(shown) < len(keys)
    assert long.startswith("step 12  train/metric_with_a_rather_long_name_0=1235  ")
    assert short == "step 13  train/loss=0.5  train/entropy=2"
    # Every line that fits is kept whole; the pure formatter agrees with the console.
    assert console_line(13, {"train/loss": 0.5, "train/entropy": 2.0}, prefix="train") == short
    for width in range(8, 200, 7):
        line = console_line(12, {f"train/{k}": v for k, v in metrics.items()}, keys=keys,
                            prefix="train", width=width)
        assert len(line) <= width and line.startswith("step 12"[:width])
    # JSONL and TensorBoard still get every key.
    assert set(read_metrics(log.path)[0]) == {"step", "time", *(f"train/{k}" for k in metrics)}


def test_a_step_without_signal_says_why(tmp_path):
    log = MetricsLogger(str(tmp_path), tensorboard=False, console=True)
    out = _console_of(log)
    tied = {"reward_mean": 1.0, "pass_rate": 1.0, "traces": 4.0, "zero_advantage_groups": 2.0,
            "trained_tokens/main": 40.0, "skipped_update": 1.0}
    log.log(1, tied, prefix="train")
    log.log(2, {**tied, "zero_advantage_groups": 0.0, "trained_tokens/main": 0.0,
                "skipped_update": 1.0}, prefix="train")
    log.log(3, {"traces": 4.0, "zero_advantage_groups": 0.0, "skipped_update": 1.0},
            prefix="train")
    log.log(4, {"traces": 0.0, "skipped_update": 1.0}, prefix="train")
    # No trained tokens (e.g. every group dropped by dynamic sampling) with a loss of 0.
    log.log(5, {"loss": 0.0, "traces": 4.0, "zero_advantage_groups": 2.0,
                "dropped_zero_advantage": 4.0, "trained_tokens/main": 0.0})
    log.log(6, {**tied, "skipped_update": 0.0, "loss": 0.25}, prefix="train")
    lines = out.getvalue().splitlines()
    assert lines == [
        "step 1  train/reward_mean=1  train/pass_rate=1  (no signal: every group tied)",
        "step 2  train/reward_mean=1  train/pass_rate=1  (no signal: no agent token to train)",
        "step 3  (no signal: no trace kept)",
        "step 4  (no signal: no traces)",
        "step 5  loss=0  (no signal: every group tied)",
        "step 6  train/reward_mean=1  train/pass_rate=1  train/loss=0.25",
    ]
    # The reason is kept when keys are dropped for width.
    line = console_line(1, {f"train/{k}": v for k, v in tied.items()}, prefix="train",
                        width=40)
    assert line == "step 1  (no signal: every group tied)"


class _FakeWandb:
    def __init__(self):
        self.calls = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        return self

    def log(self, data, step=None):
        self.calls.append(("log", data, step))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_sink_gets_the_scalars(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = MetricsLogger(str(tmp_path), tensorboard=False, console=False,
                        wandb={"project": "p", "name": "run1"})
    log.log(3, {"loss": 0.5, "note": "text"}, prefix="train")
    log.close()
    log.close()
    assert fake.calls == [("init", {"project": "p", "name": "run1"}),
                          ("log", {"train/loss": 0.5}, 3), ("finish",)]
    fake.calls.clear()
    MetricsLogger(str(tmp_path), tensorboard=False, console=False, wandb=True).close()
    assert fake.calls == [("init", {}), ("finish",)]
    fake.calls.clear()
    MetricsLogger(str(tmp_path), tensorboard=False, console=False, wandb=False).close()
    assert fake.calls == []


def test_wandb_without_the_package_is_a_one_line_hint(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed (as in this venv)
    with pytest.raises(MissingExtraError) as info:
        MetricsLogger(str(tmp_path / "m"), tensorboard=False, console=False, wandb=True)
    assert str(info.value) == ("MetricsLogger(wandb=...) needs wandb, which is not installed: "
                               "pip install 'ac2_jax[wandb]'")
    assert not (tmp_path / "m").exists()  # refused before anything is made


def test_event_files_match_tensorboardx_record_for_record(tmp_path):
    """`_tfevents` writes what tensorboardX's SummaryWriter writes for scalars (the
    reference here): the same events, field for field but the wall time, in records
    whose checksums tensorboardX's own masked CRC-32C confirms."""
    from tensorboardX import SummaryWriter
    from tensorboardX.record_writer import masked_crc32c

    from ac2_jax.training.core._tfevents import ScalarEventWriter

    points = [("train/loss", 2.5, 0), ("eval/pass_rate", 0.125, 3), ("x", -1e-3, 2**40),
              ("unicode/é", 7.0, 1)]
    files = {}
    for name, make in (("ours", ScalarEventWriter), ("ref", SummaryWriter)):
        writer = make(str(tmp_path / name))
        for tag, value, step in points:
            writer.add_scalar(tag, value, step)
        writer.close()
        (path,) = (tmp_path / name).iterdir()
        files[name] = path
    events = {}
    for name, path in files.items():
        data, i, got = path.read_bytes(), 0, []
        while i < len(data):
            header = data[i:i + 8]
            (n,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[i + 8:i + 12])[0] == masked_crc32c(header)
            body = data[i + 12:i + 12 + n]
            assert struct.unpack("<I", data[i + 12 + n:i + 16 + n])[0] == masked_crc32c(body)
            got.append(body)
            i += 16 + n
        events[name] = got
    from tensorboardX.proto.event_pb2 import Event

    def fields(body):
        event = Event.FromString(body)
        event.wall_time = 0.0
        return event

    assert len(events["ours"]) == len(events["ref"]) == 1 + len(points)
    assert fields(events["ours"][0]).file_version == "brain.Event:2"
    for ours, ref in zip(events["ours"], events["ref"], strict=True):
        assert fields(ours) == fields(ref)
