"""Processes and a full disk for the fault harness (tests/support/fault_harness.py): `Role` (one
process of the job, started again as often as needed, each run logged), `quota_open`
(an `open` whose writes fail with ENOSPC past a quota). Ports: tests/support/ports.py."""

from __future__ import annotations

import builtins
import errno
import os
import signal
import subprocess
from typing import Any

from tests.support.child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------ a full disk

def prefix_bytes(prefix: str) -> int:
    """Bytes of the files whose path starts with `prefix` (the store and its markers)."""
    d, stem = os.path.split(prefix)
    total = 0
    for root, _, files in os.walk(d):
        for n in files:
            p = os.path.join(root, n)
            if p.startswith(prefix):
                try:
                    total += os.path.getsize(p)
                except OSError:
                    pass
    return total


class _QuotaFile:
    def __init__(self, f, name: str, prefix: str, quota: int):
        self._f, self._name, self._prefix, self._quota = f, name, prefix, quota

    def write(self, s):
        self._f.flush()
        data = s.encode() if isinstance(s, str) else s
        room = self._quota - prefix_bytes(self._prefix)
        if len(data) <= room:
            return self._f.write(s)
        if room > 0:  # the disk takes what fits, as a real one does
            cut = data[:room]
            self._f.write(cut.decode(errors="ignore") if isinstance(s, str) else cut)
            self._f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._name)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def quota_open(prefix: str, quota: int):
    """An `open` whose writes to files under path `prefix` fail with ENOSPC once
    those files would hold more than `quota` bytes (tests only)."""
    prefix = os.path.abspath(prefix)

    def opener(file, mode="r", *args, **kw):
        f = builtins.open(file, mode, *args, **kw)
        if any(c in mode for c in "wax+") and os.path.abspath(os.fspath(file)).startswith(prefix):
            return _QuotaFile(f, os.fspath(file), prefix, quota)
        return f

    return opener


def _reads_strictly(path: str) -> bool:
    """The store reads with strict errors (no torn line) past the lines a kill tore."""
    from ac2_jax.trace.store import _parse_line
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    if not lines:
        return True
    try:
        _parse_line(lines[-1])
        return True
    except Exception:  # noqa: BLE001 - a torn last line
        return False


class Role:
    """One process of the job, started again as often as needed (each run logged)."""

    def __init__(self, name: str, argv: list[str], logdir: str):
        self.name, self.argv, self.logdir = name, argv, logdir
        self.proc: subprocess.Popen | None = None
        self.runs: list[dict[str, Any]] = []  # pid, log, why it ended

    def start(self, extra_env: dict[str, str] | None = None) -> None:
        env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
            filter(None, [ROOT, os.environ.get("PYTHONPATH")])), **(extra_env or {}))
        log = os.path.join(self.logdir, f"{self.name}.{len(self.runs)}.log")
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=f,
                                         stderr=subprocess.STDOUT)
        self.runs.append({"pid": self.proc.pid, "log": log, "end": None, "rc": None})

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def done(self) -> bool:  # finished its work
        return self.proc is not None and self.proc.poll() == 0

    def signal(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    def kill(self, why: str) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=60)
            self.runs[-1].update(end=why, rc=self.proc.returncode)

    def reap(self) -> int | None:
        """The exit code once it exited on its own (recorded), else None."""
        if self.proc is None or self.proc.poll() is None or self.runs[-1]["end"]:
            return None
        rc = self.proc.returncode
        self.runs[-1].update(end="exited", rc=rc)
        return rc

    def log(self, i: int = -1) -> str:
        with open(self.runs[i]["log"], errors="replace") as f:
            return f.read()


