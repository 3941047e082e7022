"""Hang watchdog: a stage (sampling, collection, train step, publish) that makes no
progress for `timeout_s` seconds dumps every thread's stack to the log, names the
stuck stage, and exits the process non-zero ("stop") or says so once ("warn").

    dog = Watchdog(timeout_s=1800, action="stop", where="learner")
    with dog.stage("collection"):
        traces = await collector.collect(step)
    dog.beat()                              # progress inside a long stage

A daemon thread polls every `poll_s`; the watchdog costs nothing on the
watched path but a clock read. Stop exits with `os._exit(EXIT_CODE)`: a hung
thread (a stuck collective, a blocked socket) cannot be unwound, so nothing
waits on it; the stacks and the line are flushed to the log first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

EXIT_CODE = 70  # EX_SOFTWARE: the run ended itself on a hang
log = logging.getLogger("ac2_jax.alarms")


def thread_stacks() -> str:
    """Every thread's current stack, as text (`sys._current_frames`)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, '?')} ({ident}) ---")
        parts.append("".join(traceback.format_stack(frame)).rstrip())
    return "\n".join(parts)


class Watchdog:
    """Watches named stages; see the module docstring. `where` names the process
    (e.g. "learner", "collector") in the line; `key` is the config key the line
    names to turn it off. `on_fire(line)` (tests, callers that stop otherwise) runs
    instead of exiting when the action is "stop"."""

    def __init__(
        self,
        timeout_s: float,
        action: str = "stop",
        *,
        where: str = "trainer",
        key: str = "alarms.hang",
        poll_s: float | None = None,
        on_fire: Callable[[str], None] | None = None,
    ):
        if action not in ("warn", "stop", "off"):
            raise ValueError(f"Watchdog: action must be warn, stop or off, got {action!r}")
        if not timeout_s > 0:
            raise ValueError(f"Watchdog: timeout_s must be > 0, got {timeout_s}")
        self.timeout_s, self.action, self.where, self.key = timeout_s, action, where, key
        self.poll_s = poll_s if poll_s is not None else min(5.0, timeout_s / 4)
        self.on_fire = on_fire
        self.fired: list[str] = []
        self._lock = threading.Lock()
        self._stage: str | None = None
        self._since = time.monotonic()
        self._warned = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if action != "off":
            self._thread = threading.Thread(target=self._watch, name="Watchdog", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def stage(self, name: str):
        """Watches `name` while the block runs (stages nest: the inner one is watched)."""
        with self._lock:
            outer, self._stage = self._stage, name
            self._since, self._warned = time.monotonic(), False
        try:
            yield self
        finally:
            with self._lock:
                self._stage = outer
                self._since, self._warned = time.monotonic(), False

    def beat(self) -> None:
        """Progress inside the current stage: its clock starts again."""
        with self._lock:
            self._since, self._warned = time.monotonic(), False

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                stage, idle = self._stage, time.monotonic() - self._since
                due = stage is not None and idle > self.timeout_s and not self._warned
                if due:
                    self._warned = True
            if due:
                self._fire(stage, idle)

    def _fire(self, stage: str | None, idle: float) -> None:
        line = (
            f"ALARM hang ({self.action}): stage {stage!r} of the {self.where} made no progress "
            f"for {idle:.0f}s (limit {self.timeout_s:g}s); every thread's stack is above; turn "
            f"off with --config.{self.key}.action=off"
        )
        log.error("thread stacks of the %s (stage %r stuck):\n%s", self.where, stage,
                  thread_stacks())  # fmt: skip
        self.fired.append(line)
        if self.action == "warn":
            log.warning("%s", line)
            return
        log.error("%s", line)
        if self.on_fire is not None:
            self.on_fire(line)
            return
        for h in logging.getLogger().handlers + log.handlers:
            with contextlib.suppress(Exception):
                h.flush()
        print(line, file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_s + 1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
