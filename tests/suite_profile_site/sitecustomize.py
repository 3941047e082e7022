"""Compile time of a test's Python subprocesses (tests/suite_profile.py).

On PYTHONPATH only under scripts/test_profile.sh. When the child imports JAX, a
listener sums JAX's compile events; at exit it writes `<dir>/sub-<pid>.json` with
the test that started it. A child that never imports JAX writes nothing."""

import atexit
import importlib.abc
import importlib.util
import json
import os
import sys

_DIR = os.environ.get("AC2_TEST_PROFILE")
_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


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

    total = [0.0]

    def listener(event, duration, **_):
        if event in _EVENTS:
            total[0] += duration

    jax.monitoring.register_event_duration_secs_listener(listener)

    def write():
        rec = {"test": os.environ.get("AC2_TEST_PROFILE_TEST"), "compile_s": total[0],
               "argv": sys.argv[:3]}
        with open(os.path.join(_DIR, f"sub-{os.getpid()}.json"), "w") as f:
            json.dump(rec, f)

    atexit.register(write)


if _DIR and os.environ.get("AC2_TEST_PROFILE_TEST"):
    sys.meta_path.insert(0, _AfterJaxImport())
