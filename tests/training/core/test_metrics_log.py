"""Metrics sinks (ac2_jax.training.core.metrics_log): prefixed keys in the JSONL and in
TensorBoard, and non-numeric values counted, never silently lost."""

import math
import os
import struct

from ac2_jax.training.core import MetricsLogger, read_metrics


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
