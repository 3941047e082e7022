"""Compile time of a test's Python subprocesses (tests/support/suite_profile.py).

On PYTHONPATH only under scripts/test_profile.sh. When the child imports JAX, a
listener appends each compile event's seconds to `<dir>/sub-<pid>.jsonl`, tagged with
the test that started it; written as they happen, so a server ended by SIGTERM or
SIGKILL still counts. A child that never imports JAX writes nothing. Persistent
compilation cache hits and misses are written the same way (`{"cache": "hit"}`)."""

import importlib.abc
import importlib.util
import json
import os
import sys

_DIR = os.environ.get("AC2_TEST_PROFILE")
_TEST = os.environ.get("AC2_TEST_PROFILE_TEST")
COMPILE_EVENTS = (  # also read by tests/support/suite_profile.py
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
# Persistent compilation cache (jax/_src/compiler.py, compilation_cache.py): a hit is
# an executable read back; a miss is one compiled and written (every compile is
# written in the suite: thresholds 0). Also read by tests/support/suite_profile.py.
CACHE_EVENTS = {
    "/jax/compilation_cache/cache_hits": "hit",
    "/jax/compilation_cache/cache_misses": "miss",
}


class _AfterJaxImport(importlib.abc.MetaPathFinder):
    """Registers the listener right after `jax` is first imported."""

    def find_spec(self, name, path, target=None):
        if name != "jax":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("jax")
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_listen(module):
            exec_module(module)
            _listen()

        spec.loader.exec_module = exec_then_listen
        return spec


def _listen():
    import jax.monitoring

    path = os.path.join(_DIR, f"sub-{os.getpid()}.jsonl")

    def listener(event, duration, **_):
        if event in COMPILE_EVENTS:
            with open(path, "a") as f:
                f.write(json.dumps({"test": _TEST, "compile_s": duration}) + "\n")

    def cache_listener(event, **_):
        if event in CACHE_EVENTS:
            with open(path, "a") as f:
                f.write(json.dumps({"test": _TEST, "cache": CACHE_EVENTS[event]}) + "\n")

    jax.monitoring.register_event_duration_secs_listener(listener)
    jax.monitoring.register_event_listener(cache_listener)


if _DIR and _TEST:
    sys.meta_path.insert(0, _AfterJaxImport())
