"""The environment of a JAX child process a test starts (a server, a learner, a worker).

tests/conftest.py sets XLA_FLAGS for the suite: 8 forced host devices, and LLVM at -O0
without XLA:CPU's fusion emitters (2-3x less compile time; why: its docstring). A child
is one process as deployed, on one CPU device (or the devices it asks for itself, e.g.
`jax_num_cpu_devices`), so it must not inherit the forced device count; but dropping all
of XLA_FLAGS made every child compile at XLA's defaults, 2-3x longer, and the children's
compiles were most of the multi-process tests' time (issue 60). `child_xla_flags`
(benchmarks/common.py, which the benchmarks' own servers use) keeps the compile flags and
leaves out the device count; the children also share the run's persistent compilation
cache (`JAX_COMPILATION_CACHE_DIR`, inherited), where one program under the same flags is
compiled once for all of them.
"""

from __future__ import annotations

import os

from benchmarks.common import child_xla_flags

__all__ = ["child_env", "child_xla_flags"]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a JAX child: XLA_FLAGS as `child_xla_flags`,
    JAX_PLATFORMS=cpu unless set, then `extra`."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = child_xla_flags()
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.update(extra)
    return env
