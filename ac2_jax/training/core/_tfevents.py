"""TensorBoard scalar event files, written without TensorBoard or tensorboardX.

The format TensorBoard reads (`events.out.tfevents.<time>.<host>`): TFRecords, each
`u64 length | u32 masked crc32c(length) | data | u32 masked crc32c(data)` (little
endian), whose data is one serialized `tensorflow.Event` protobuf. The first event
holds `file_version = "brain.Event:2"`; each scalar is an event with `wall_time`
(field 1, double), `step` (2, int64) and a `summary` (5) of one `Summary.Value` with
`tag` (1, string) and `simple_value` (2, float). Only scalars are written, so the few
protobuf fields are encoded here by hand.

Why not tensorboardX: importing it imports torch when torch is installed (1.5-2.3 CPU s
and ~300 MB in every process that trains, though none of it is used for scalars;
docs/notes/2026-12-08-suite-in-20-minutes-seventh-session.md).
"""

from __future__ import annotations

import os
import socket
import struct
import time


def _crc32c_table() -> tuple[int, ...]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli, reflected
        table.append(c)
    return tuple(table)


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotated right by 15 bits, plus a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # int64 as protobuf encodes it (a negative one takes 10 bytes)
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (strings, messages)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def scalar_event(tag: str, value: float, step: int, wall_time: float) -> bytes:
    """One serialized Event of a scalar summary."""
    summary_value = _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value)
    return (
        b"\x09"
        + struct.pack("<d", wall_time)
        + b"\x10"
        + _varint(step)
        + _field(5, _field(1, summary_value))
    )


def version_event(wall_time: float) -> bytes:
    """The first Event of a file: its format version."""
    return b"\x09" + struct.pack("<d", wall_time) + _field(3, b"brain.Event:2")


def record(data: bytes) -> bytes:
    """`data` framed as one TFRecord."""
    header = struct.pack("<Q", len(data))
    return (
        header
        + struct.pack("<I", masked_crc32c(header))
        + data
        + struct.pack("<I", masked_crc32c(data))
    )


class ScalarEventWriter:
    """Appends scalar events to a new event file under `directory`: `add_scalar` as
    tensorboardX's `SummaryWriter`; `flush` makes them visible; `close` ends the file."""

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        now = time.time()
        name = f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}"
        self.path = os.path.join(directory, name)
        self._file = open(self.path, "ab")  # noqa: SIM115 (held until close)
        self._file.write(record(version_event(now)))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._file.write(record(scalar_event(tag, float(value), int(step), time.time())))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
