"""Tool functions for tests/envs/test_sandbox.py: module-level (picklable by reference),
standard library only, so a sandbox child imports them fast."""

import ctypes
import os
import sys
import time


def add(a: int, b: int) -> str:
    return str(a + b)


def spin() -> None:
    """Burns CPU forever."""
    while True:
        pass


def sleep_forever() -> None:
    """Uses no CPU, never returns: only the wall-time limit stops it."""
    while True:
        time.sleep(1)


def allocate(mb: int) -> str:
    return str(len(bytearray(mb * 1024 * 1024)))


def abort() -> None:
    os.abort()


def segfault() -> None:
    ctypes.string_at(0)


def exit3() -> None:
    sys.exit(3)


def raise_value() -> None:
    raise ValueError("no such thing")


def read_env(name: str) -> str:
    return repr(os.environ.get(name))


def where() -> str:
    """The child's cwd, HOME, and whether a file written there exists."""
    with open("note.txt", "w") as f:
        f.write("x")
    return f"{os.getcwd()}|{os.environ.get('HOME')}|{os.path.exists('note.txt')}"


def shout(n: int) -> str:
    """Writes n bytes to stdout and to stderr, returns n."""
    sys.stdout.write("o" * n)
    sys.stderr.write("e" * n)
    return str(n)


def limits() -> str:
    """The child's core, CPU and address-space limits (soft, hard)."""
    import resource
    return repr([resource.getrlimit(r) for r in
                 (resource.RLIMIT_CORE, resource.RLIMIT_CPU, resource.RLIMIT_AS)])


def spawn_and_hang(pid_file: str) -> None:
    """Starts a grandchild `sleep`, writes its pid to pid_file, then hangs."""
    import subprocess
    p = subprocess.Popen(["sleep", "300"])
    with open(pid_file, "w") as f:
        f.write(str(p.pid))
    while True:
        time.sleep(1)


def escape_and_hang(pid_file: str) -> None:
    """Starts a `sleep` in its own session (out of the group) holding stdout, then hangs."""
    import subprocess
    p = subprocess.Popen(["sleep", "300"], start_new_session=True)
    with open(pid_file, "w") as f:
        f.write(str(p.pid))
    while True:
        time.sleep(1)
