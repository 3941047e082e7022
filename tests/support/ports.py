"""Ports for tests that run side by side (pytest-xdist workers), without races.

Binding port 0 and handing the number to a process that binds it later races: the
kernel may give that port to anyone else in between (another worker's server, an
outgoing connection). Two helpers close the gap:

- `refused_url()`: a URL where connections are refused. Its socket stays bound (never
  listening) until the process exits, so nobody else can take the port.
- `reserved_port()`: a port a child process binds later (a server started with
  `--port=N`, a role restarted on the same port, JAX's coordinator). It comes from a
  block below the kernel's ephemeral range, which port-0 binds and outgoing
  connections never draw from. Each process claims a block of its own with a lock file
  (held until it exits: xdist workers, and two test runs side by side, never share
  one), and a port never repeats within a process, so two tests cannot be handed the
  same port.

Servers in the test process itself bind port 0 and read it back
(`ac2_jax.serving.serve_in_thread`).
"""

from __future__ import annotations

import fcntl
import itertools
import os
import socket
import tempfile
from typing import IO

_HELD: list[socket.socket] = []
_BASE = 20000  # the ephemeral range starts at 32768 (net.ipv4.ip_local_port_range)
_BLOCK = 500  # ports per process
_block: tuple[int, IO[str]] | None = None  # (first port, the open lock file)
_next = itertools.count()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _claim_block() -> int:
    global _block
    if _block is None:
        for lo in range(_BASE, _ephemeral_low() - _BLOCK + 1, _BLOCK):
            lock = open(os.path.join(tempfile.gettempdir(), f"ac2-test-ports-{lo}.lock"), "w")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # another process holds this block
                lock.close()
                continue
            _block = (lo, lock)
            break
        else:
            raise RuntimeError(f"every block of ports in {_BASE}-{_ephemeral_low()} is held by "
                               "another test process")
    return _block[0]


def reserved_port() -> int:
    """A free port of this process's block (below the ephemeral range)."""
    lo = _claim_block()
    for _ in range(_BLOCK):
        port = lo + next(_next) % _BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # still held (a lingering server, TIME_WAIT): the next one
                continue
        return port
    raise RuntimeError(f"no free port in {lo}-{lo + _BLOCK}")


def refused_url() -> str:
    """http://127.0.0.1:PORT where nothing listens, for the rest of this process."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _HELD.append(s)
    return f"http://127.0.0.1:{s.getsockname()[1]}"
