"""Test setup: 8 forced CPU devices, before JAX initializes."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _fresh_jax_caches_per_module():
    """Drops the compiled executables of each test module when it ends (after its
    own module fixtures, which this one outlives). The suite runs ~1,330 tests in
    one process: with every module's executables kept, its peak RSS was 6.7 GB and
    one run died at 97% in an XLA:CPU compile (a segfault in backend_compile; the
    cause not established); with this, 4.1 GB and no crash (BUILD_NOTES, "Test
    suite"). Modules rarely share a compiled shape, so little is recompiled."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()


def pytest_configure(config):
    """`AC2_TEST_PROFILE=<dir>` (scripts/test_profile.sh): time and compile seconds per
    test, written under <dir> (tests/suite_profile.py)."""
    out_dir = os.environ.get("AC2_TEST_PROFILE")
    if out_dir:
        from suite_profile import ProfilePlugin

        config.pluginmanager.register(ProfilePlugin(out_dir), "ac2_suite_profile")
