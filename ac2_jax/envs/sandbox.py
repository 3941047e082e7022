"""Sandboxed tools: a tool call in a fresh child process with resource limits.

`Tool(..., sandbox=SandboxLimits(...))` makes `run_tool` run the call in a
new Python process (`python -I`, started fresh, not forked), in its own
process group, with:

- RLIMIT_CPU (`cpu_s`: SIGXCPU, then SIGKILL a second later), RLIMIT_AS
  (`memory_mb`: the whole address space, interpreter and imports included,
  set after the tool's module is imported), RLIMIT_CORE = 0 (no core dumps);
- a wall-clock limit (`wall_s`, default the tool's `timeout_s`) that kills the
  whole process group;
- a fresh scratch directory as cwd, HOME and TMPDIR, removed afterwards;
- an environment of the allow-listed variables only (`env_allow`; names
  containing KEY, TOKEN, SECRET, PASSWORD or CREDENTIAL are never passed);
- stdout and stderr captured, each cut to `output_bytes` (the result text
  too), saying how many bytes were cut.

The tool's `fn` crosses to the child by pickle, by reference: it must be a
module-level function (or a functools.partial of one) in a module the child
can import (the child gets the parent's sys.path); `Tool` checks this when
it is built. Every failure (limit hit, crash, signal, nonzero exit, an
exception or MemoryError in the tool) comes back as `error: <tool>: ...` text
with ok=False, never as an exception. The call runs as an asyncio subprocess,
so the event loop keeps running. Grandchildren that leave the process group
(setsid) are not tracked.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")
DEFAULT_ENV_ALLOW = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONPATH")
_DRAIN_GRACE_S = 2.0  # after the group is killed, how long to wait for the pipes' EOF


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
    """Limits of a sandboxed tool call. None: that limit is not set.

    wall_s: wall-clock seconds (None: the tool's timeout_s); cpu_s: CPU
    seconds (rounded up to whole seconds); memory_mb: address space of the
    child; output_bytes: kept of stdout, of stderr, and of the result text.
    """

    wall_s: float | None = None
    cpu_s: float | None = 10.0
    memory_mb: int | None = 1024
    output_bytes: int = 16_384
    env_allow: tuple[str, ...] = DEFAULT_ENV_ALLOW

    def __post_init__(self):
        for name in ("wall_s", "cpu_s", "memory_mb"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0 or None, got {v!r}")
        if self.output_bytes < 1:
            raise ValueError(f"SandboxLimits.output_bytes must be >= 1, got {self.output_bytes}")
        secret = [n for n in self.env_allow if _is_secret(n)]
        if secret:
            raise ValueError(
                f"SandboxLimits.env_allow lists {secret}: names containing "
                f"{'/'.join(SECRET_MARKERS)} never reach a sandboxed tool; "
                "remove them (pass what the tool needs as arguments)"
            )


def _is_secret(name: str) -> bool:
    return any(m in name.upper() for m in SECRET_MARKERS)


def check_sandboxable(name: str, fn: Callable[..., Any]) -> None:
    """Raises ValueError unless `fn` can be sent to a fresh child process."""
    target = getattr(fn, "func", fn)  # a functools.partial's function
    if getattr(target, "__module__", None) == "__main__":
        raise ValueError(
            f"Tool {name!r}: a sandboxed tool's fn is defined in __main__, which "
            "a fresh child process cannot import; move it into a module"
        )
    try:
        pickle.dumps(fn)
    except Exception as e:  # noqa: BLE001 - any pickling failure means the same fix
        raise ValueError(
            f"Tool {name!r}: a sandboxed tool's fn must be picklable by reference "
            "(a module-level function, or a functools.partial of one; not a lambda, "
            f"closure or local function): {type(e).__name__}: {e}"
        ) from None


def _child_env(limits: SandboxLimits, scratch: str) -> dict[str, str]:
    """The child's environment: allow-listed variables without secrets, HOME=TMPDIR=scratch."""
    env = {k: os.environ[k] for k in limits.env_allow if k in os.environ and not _is_secret(k)}
    env.update(HOME=scratch, TMPDIR=scratch)
    return env


class _Capture(asyncio.SubprocessProtocol):
    """Keeps the first `cap` bytes of the child's stdout (fd 1) and stderr (fd 2),
    counts the rest; `exited` resolves at the child's exit, `closed` once its
    pipes are closed too."""

    def __init__(self, cap: int, loop: asyncio.AbstractEventLoop):
        self.cap = cap
        self.kept = {1: bytearray(), 2: bytearray()}
        self.total = {1: 0, 2: 0}
        self.exited, self.closed = loop.create_future(), loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self.total[fd] += len(data)
        kept = self.kept[fd]
        if len(kept) < self.cap:
            kept += data[: self.cap - len(kept)]

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def captured(self, fd: int) -> tuple[bytes, int]:
        return bytes(self.kept[fd]), self.total[fd]


def _section(label: str, captured: tuple[bytes, int] | None) -> str:
    if not captured or not captured[1]:
        return ""
    kept, total = captured
    text = f"\n--- {label} ---\n{kept.decode('utf-8', 'replace')}"
    if total > len(kept):
        text += f"\n[{label} cut: {total - len(kept)} more bytes not shown]"
    return text


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _failure(
    name: str,
    limits: SandboxLimits,
    wall_s: float,
    timed_out: bool,
    returncode: int | None,
    result: dict | None,
) -> str | None:
    """The error text of a failed call, or None when it succeeded."""
    if timed_out:
        return f"error: {name}: killed after the wall-time limit of {wall_s:g}s"
    if returncode is not None and returncode < 0:
        sig = -returncode
        try:
            signame = signal.Signals(sig).name
        except ValueError:
            signame = f"signal {sig}"
        if sig == signal.SIGXCPU and limits.cpu_s is not None:
            return f"error: {name}: CPU time limit of {limits.cpu_s:g}s hit (killed by SIGXCPU)"
        return f"error: {name}: the sandboxed tool was killed by {signame}"
    if returncode:
        return f"error: {name}: the sandboxed tool exited with status {returncode}"
    if result is None:
        return f"error: {name}: the sandboxed tool exited without a result"
    if result["ok"]:
        return None
    if result.get("kind") == "memory":
        return f"error: {name}: memory limit of {limits.memory_mb} MB hit ({result['error']})"
    if result.get("kind") == "setup":
        return f"error: {name}: the sandbox could not load the tool ({result['error']})"
    return f"error: {name}: {result['error']}"


async def run_sandboxed(
    name: str, fn: Callable[..., Any], kwargs: dict[str, Any], limits: SandboxLimits, wall_s: float
) -> tuple[str, bool]:
    """Runs fn(**kwargs) in a fresh limited child; returns (text for the model, ok)."""
    wall_s = limits.wall_s if limits.wall_s is not None else wall_s
    root = tempfile.mkdtemp(prefix="ac2-sandbox-")
    try:
        scratch = os.path.join(root, "scratch")
        os.mkdir(scratch)
        try:
            payload = pickle.dumps((fn, kwargs))
        except Exception as e:  # noqa: BLE001 - e.g. an argument that does not pickle
            return f"error: {name}: the call could not be sent to the sandbox ({e})", False
        with open(os.path.join(root, "call.pickle"), "wb") as f:
            f.write(payload)
        with open(os.path.join(root, "call.json"), "w", encoding="utf-8") as f:
            json.dump(
                {
                    "sys_path": [os.path.abspath(p) for p in sys.path],
                    "cpu_s": limits.cpu_s,
                    "memory_mb": limits.memory_mb,
                    "output_bytes": limits.output_bytes,
                },
                f,
            )
        loop = asyncio.get_running_loop()
        transport, capture = await loop.subprocess_exec(
            lambda: _Capture(limits.output_bytes, loop),
            sys.executable,
            "-I",
            _CHILD,
            root,
            cwd=scratch,
            env=_child_env(limits, scratch),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        timed_out = False
        try:
            await asyncio.wait_for(asyncio.shield(capture.exited), wall_s)
        except TimeoutError:
            timed_out = True
        finally:  # also on cancellation: nothing of the call outlives it
            _kill_group(transport.get_pid())
            if not capture.closed.done():  # bounded: a process that left the group
                await asyncio.wait([capture.closed], timeout=_DRAIN_GRACE_S)  # may hold a pipe
            transport.close()
        if not capture.closed.done():
            logging.warning(
                "sandboxed tool %s: a process outside its process group kept its "
                "output open; output after the kill is not read",
                name,
            )
        out, err = capture.captured(1), capture.captured(2)
        returncode = transport.get_returncode()
        result = _read_result(os.path.join(root, "result.json"))
        error = _failure(name, limits, wall_s, timed_out, returncode, result)
        if result is not None and result.get("kind") == "setup":
            logging.warning("sandboxed tool %s: %s", name, error)  # ours: the env's setup
        if error is not None:
            return error + _section("stderr", err) + _section("stdout", out), False
        if result is None:  # no error means the tool wrote its result
            raise RuntimeError(f"sandboxed tool {name}: no result and no error")
        return result["text"] + _section("stdout", out) + _section("stderr", err), True
    finally:
        await asyncio.to_thread(_remove, root)


def _read_result(path: str) -> dict | None:
    """The child's result, or None when it wrote none (or the tool overwrote it badly)."""
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    ok = (
        isinstance(result, dict)
        and isinstance(result.get("ok"), bool)
        and (
            isinstance(result.get("text"), str)
            if result["ok"]
            else isinstance(result.get("error"), str)
        )
    )
    return result if ok else None


def _remove(root: str) -> None:
    try:
        shutil.rmtree(root)
    except OSError as e:  # e.g. the tool made a directory unreadable
        logging.warning("sandbox: could not remove the scratch directory %s: %s", root, e)
