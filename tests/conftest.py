"""Test setup, before JAX initializes: 8 forced CPU devices, LLVM at -O0 without
XLA:CPU's fusion emitters, and one persistent compilation cache for the whole run.

-O0 (`--xla_backend_optimization_level=0`): a tiny-model test is mostly XLA:CPU
compilation, and most of that is LLVM optimising code that then runs a few times.
Side by side on 2 cores, 55 tests of the decoder, sampler and train step took 238 s
at -O0 and 308 s at the default (docs/notes/2026-12-07-suite-in-20-minutes.md). The HLO
passes (fusion, layout, buffer assignment) are the same; the numbers are IEEE fp32
either way, and every tolerance in the suite holds. A caller's own level is kept.

No fusion emitters (`--xla_cpu_use_fusion_emitters=false`): XLA:CPU then emits its
fusions with the classic LLVM IR emitters instead of generating each through MLIR.
Compiling the tiny model's train step took 2-3x less (1.6-2.6 s vs 3.8-6.2 s), and
test_train_step.py + test_decoder.py took 125-129 s vs 277-285 s, side by side
(docs/notes/2026-12-07-suite-in-20-minutes-second-session.md). Same ops, same
fp32 results within every tolerance of the suite. A caller's own setting is kept.

The cache: `JAX_COMPILATION_CACHE_DIR` is a new temporary directory per run (made by
the first process, so pytest-xdist workers and every JAX subprocess a test starts
inherit it; removed when that process exits), every compile is written (thresholds
0). A shape compiled once (the tiny model's train step, the sampler's decode chunk)
is then read back, not recompiled, after `_fresh_jax_caches_per_module` drops the
in-memory executables, in the other worker, and in the pipeline tests' children.
A cache hit still reports JAX's compile event, so tests that count compiles count
the same. `JAX_COMPILATION_CACHE_DIR` set by the caller is kept (a cache across runs:
faster, but then timings are not a fresh run's)."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The opt-in RL steps from real CLI rollouts (AC2_CLI_RL_STEP=1, tests/orchestration/
# test_cli_presets.py) run block-sparse attention over 30k-48k-token rows: runtime, not
# compilation. At -O0 without fusion emitters its forward ran 17x and forward + backward
# 7x slower than at XLA's defaults (4,096 tokens;
# docs/notes/2026-12-07-default-settings-cli-rl-steps.md), so such a run keeps XLA's
# defaults.
_RUNTIME_BOUND = os.environ.get("AC2_CLI_RL_STEP") == "1"
for _flag in (
    "--xla_force_host_platform_device_count=8",
    *(() if _RUNTIME_BOUND else (
        "--xla_backend_optimization_level=0",
        "--xla_cpu_use_fusion_emitters=false",
    )),
):
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _cache_dir = tempfile.mkdtemp(prefix="ac2-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
# One scratch directory per run for fixtures that several modules (and both xdist
# workers) can share by value, not by program: e.g. serving_helpers.fit_tiny_model's
# fitted weights (a deterministic fit, done once per run instead of once per module).
if not os.environ.get("AC2_TEST_RUN_DIR"):
    _run_dir = tempfile.mkdtemp(prefix="ac2-test-run-")
    os.environ["AC2_TEST_RUN_DIR"] = _run_dir
    atexit.register(shutil.rmtree, _run_dir, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _fresh_jax_caches_per_module():
    """Drops the compiled executables of each test module when it ends (after its
    own module fixtures, which this one outlives). The suite runs ~1,330 tests in
    one process: with every module's executables kept, its peak RSS was 6.7 GB and
    one run died at 97% in an XLA:CPU compile (a segfault in backend_compile; the
    cause not established); with this, 4.1 GB and no crash (docs/notes/test-runs.md,
    "Test suite, 2026-12-05 (end of session)"). Modules rarely share a compiled shape, so
    little is recompiled."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _no_alarm_fired(request):
    """A healthy test fires no correctness alarm (issue 65: the RL alarms are on by
    default, so every RL run of the suite is a healthy run that must stay quiet): an
    ALARM line logged during a test fails it, unless the test is marked
    `alarms_expected` (it injects the fault on purpose; `alarms_expected("drift")`:
    only those alarms, e.g. a test whose traces carry made-up log-probs)."""
    import logging

    lines: list[str] = []

    class _Catch(logging.Handler):
        def emit(self, record):
            if record.getMessage().startswith("ALARM "):
                lines.append(record.getMessage())

    handler, log = _Catch(logging.WARNING), logging.getLogger("ac2_jax.alarms")
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)
    marker = request.node.get_closest_marker("alarms_expected")
    if marker is not None:  # no names: any alarm
        lines = [x for x in lines if marker.args and x.split()[1] not in marker.args]
    if lines:
        pytest.fail("a correctness alarm fired in a healthy run:\n" + "\n".join(lines))


def pytest_configure(config):
    """`AC2_TEST_PROFILE=<dir>` (scripts/test_profile.sh): time and compile seconds per
    test, written under <dir> (tests/support/suite_profile.py)."""
    config.addinivalue_line(
        "markers", "alarms_expected(*names): the test fires (those) correctness alarms on purpose"
    )
    out_dir = os.environ.get("AC2_TEST_PROFILE")
    if out_dir:
        from tests.support.suite_profile import ProfilePlugin

        config.pluginmanager.register(ProfilePlugin(out_dir), "ac2_suite_profile")


# ------------------------------------------------------------------ tiers and order
# `scripts/test.sh` runs every test; `scripts/test.sh --quick` (`-m "not full"`) leaves
# out what needs minutes or other processes. A test is `full` when its file is listed
# here, or when it carries `@pytest.mark.full` itself.
FULL_ONLY = {
    "tests/benchmarks/": "benchmark pipelines (toy-size runs of benchmarks/)",
    "tests/experiments/": "experiment pipelines (toy-size runs of experiments/)",
    "tests/notebooks/": "notebooks under a kernel",
    "tests/test_docs.py": "the docs build",
    "tests/test_readme.py": "the README's example, end to end",
    "tests/test_train.py": "the launcher in child processes",
    "tests/training/core/test_distributed.py": "multi-process JAX over gloo",
    "tests/training/rl/test_split.py": "the split RL job as processes",
    "tests/training/rl/test_faults.py": "the fault harness",
    "tests/orchestration/test_cli_presets.py": "real CLI agents (Node.js processes)",
    "tests/recipes/test_recipe_rl.py": "a recipe end to end",
    "tests/recipes/test_recipe_distill.py": "a recipe end to end",
    "tests/recipes/test_recipe_sft.py": "a recipe end to end",
    "tests/examples/": "the example envs' sandboxed code, in processes",
    "tests/envs/test_sandbox.py": "sandboxed tools, each call a child process (limits, kills)",
    "tests/orchestration/test_cli_agent.py": "real programs as agents, each a process",
    "tests/recipes/test_recipe_samplers.py": "a recipe end to end on a fleet of servers",
}


# The longest files, longest first (scripts/test_profile.sh,
# docs/notes/2026-12-07-suite-in-20-minutes*.md); the rest keep pytest's order. A stale
# list costs balance, never a test.
HEAVY = [
    "tests/test_train.py",
    "tests/experiments/test_calculator_agent.py",
    "tests/notebooks/test_notebooks.py",
    "tests/experiments/test_pinapple.py",
    "tests/training/rl/test_faults.py",
    "tests/orchestration/test_cli_presets.py",
    "tests/test_first_day.py",
    "tests/training/rl/test_rl_trainer.py",
    "tests/training/core/test_distributed.py",
    "tests/training/core/test_train_step.py",
    "tests/sampling/test_jax_sampler.py",
    "tests/experiments/test_pinapple_base.py",
    "tests/benchmarks/test_bench_endpoint.py",
    "tests/recipes/test_recipe_adapters.py",
]


def is_full_only(path: str) -> bool:
    """Whether FULL_ONLY lists the file `path` (relative to the repository), by itself or
    by its folder."""
    return any(path.startswith(key) for key in FULL_ONLY)


def pytest_collection_modifyitems(config, items):
    """Marks the full-only tests (FULL_ONLY), then orders files heaviest first (HEAVY
    below) so that pytest-xdist's per-file scheduling does not end on one long file
    while the other worker idles. The order within a file is kept."""
    root = str(config.rootpath) + os.sep
    for item in items:
        if is_full_only(str(item.path).removeprefix(root)):
            item.add_marker(pytest.mark.full)
    if len(items) > 1:
        rank = {path: i for i, path in enumerate(HEAVY)}

        def key(item):
            rel = str(item.path).removeprefix(root)
            return rank.get(rel, len(HEAVY))

        items.sort(key=key)  # stable: files stay together, tests keep their order
