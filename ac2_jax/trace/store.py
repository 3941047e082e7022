"""TraceStore: append-only JSONL of traces on disk.

One trace per line, `{"schema": 1, "trace": {...}}`. Each append is flushed
and fsynced, so a crash loses at most the line being written. `read()`
returns a list; `iter_traces()` (and iterating the store) streams line by
line, for stores too large to hold. Either way a corrupt or truncated line
raises `TraceStoreError` naming the file and line, or is skipped with a
warning when `on_error="skip"`. Valid lines are never lost. JSON only, never pickle.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections.abc import Iterator

from ac2_jax.trace.types import Trace

SCHEMA_VERSION = 1


class TraceStoreError(ValueError):
    """A line of a trace store could not be read."""


class TraceStore:
    """Append-only JSONL file of `Trace`s."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self._lock = threading.Lock()
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)

    def append(self, trace: Trace) -> None:
        """Writes one trace as one line, flushed and fsynced."""
        line = json.dumps(
            {"schema": SCHEMA_VERSION, "trace": trace.to_dict()},
            separators=(",", ":"),
            allow_nan=False,
        )
        with self._lock:
            # A previous writer may have died mid-line; never glue onto it.
            size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
            needs_newline = False
            if size > 0:
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    needs_newline = f.read(1) != b"\n"
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    if needs_newline:
                        f.write("\n")
                    f.write(line + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as e:
                raise self._write_failed(e, size) from e

    def _write_failed(self, e: OSError, size: int) -> OSError:
        """A failed append (a full disk: ENOSPC, EDQUOT; EIO): cuts the file back to
        `size`, so no torn line follows the traces already stored, and says so."""
        try:
            os.truncate(self.path, size)
            kept = f"cut back to its {size} bytes before this write (every trace stored is intact)"
        except OSError as e2:  # e.g. the disk went away altogether
            kept = (
                f"could not be cut back to {size} bytes ({e2}); a reader skips the torn last line"
            )
        return OSError(
            e.errno,
            f"TraceStore: could not append a trace to {self.path} ({e.strerror or e}); "
            f"the file is {kept}. Free space on its disk (or raise the quota) and "
            "start the writer again (a collector runs the attempts not stored again)",
        )

    def extend(self, traces) -> None:
        for t in traces:
            self.append(t)

    def __iter__(self) -> Iterator[Trace]:
        return self.iter_traces()

    def read(self, on_error: str = "raise") -> list[Trace]:
        """All traces, as a list. on_error: "raise" (default) or "skip" (warn).

        Reads the whole file into memory; `iter_traces` streams it instead.
        """
        _check_on_error(on_error)
        return list(self._stream(on_error, stacklevel=3))

    def iter_traces(self, on_error: str = "raise") -> Iterator[Trace]:
        """Streams traces one line at a time (a generator; nothing is read until
        iterated). on_error: "raise" (default) or "skip" (warn), as `read`."""
        _check_on_error(on_error)
        return self._stream(on_error, stacklevel=2)

    def _stream(self, on_error: str, stacklevel: int) -> Iterator[Trace]:
        if not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    trace = _parse_line(line)
                except Exception as e:  # noqa: BLE001 - reported with location
                    msg = f"{self.path}:{lineno}: unreadable trace line ({e})"
                    if on_error == "raise":
                        raise TraceStoreError(msg) from e
                    warnings.warn(msg + "; skipped", stacklevel=stacklevel)
                    continue
                yield trace

    def load(self, on_error: str = "raise") -> list[Trace]:
        """The same as `read`."""
        _check_on_error(on_error)
        return list(self._stream(on_error, stacklevel=3))

    def __len__(self) -> int:
        return sum(1 for _ in self.iter_traces(on_error="skip"))


def _check_on_error(on_error: str) -> None:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")


def _parse_line(line: str) -> Trace:
    if not line.endswith("\n"):
        # Could still be valid JSON, but only a completed write ends in newline.
        try:
            json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"truncated line: {e}") from None
    record = json.loads(line)
    if not isinstance(record, dict) or "trace" not in record:
        raise ValueError("not a trace record (missing 'trace')")
    schema = record.get("schema")
    if schema != SCHEMA_VERSION:
        raise ValueError(f"unsupported schema version {schema!r} (expected {SCHEMA_VERSION})")
    return Trace.from_dict(record["trace"])
