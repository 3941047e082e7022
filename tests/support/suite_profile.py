"""Where the suite's time goes: wall time and JAX compile time per test and per module.

Run it through `scripts/test_profile.sh` (same arguments as pytest). With
`AC2_TEST_PROFILE=<dir>` set, tests/conftest.py registers `ProfilePlugin`, which
appends one JSON line per test to `<dir>/tests-<pid>.jsonl`:

    {"test": nodeid, "wall_s": setup + call + teardown, "compile_s": ..., "outcome": ...,
     "cache_hits": ..., "cache_misses": ..., "cpu_s": ...}

`compile_s` is the sum of JAX's three compile events (tracing to a jaxpr, lowering to
MLIR, the XLA backend compile; `jax.monitoring` duration events) seen while the test
ran. Subprocesses count too: the script puts `tests/support/suite_profile_site` on
PYTHONPATH, whose `sitecustomize` registers the same listener in every Python child
that imports JAX and appends each compile to `<dir>/sub-<pid>.jsonl`, tagged with the test that
was running (`AC2_TEST_PROFILE_TEST`, set here for each test). A test that runs
several JAX processes at once can show more compile seconds than wall seconds.

`cache_hits` / `cache_misses` count the run-wide persistent compilation cache's
answers (JAX's `/jax/compilation_cache/cache_hits` and `.../cache_misses` events;
a miss is a compile written to the cache), in the process and its children; the
per-module table shows the hit share (`hit%`).

`cpu_s` is the CPU time (user + system, every thread) of the pytest process and of
the child processes it waited for while the test ran; the report's `idle_s` is
wall - cpu where positive: time the test spent on no CPU (sleeps, timeouts, waiting
for a server or a child it did not wait for; on a loaded machine also the wait for
a CPU, so measure it alone). A suite whose idle time is large gains from more
workers than cores; one with none does not.

`python -m tests.support.suite_profile <dir> [--top N]` prints the per-module table and the
N slowest tests (default 50).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from tests.support.suite_profile_site.sitecustomize import CACHE_EVENTS, COMPILE_EVENTS

TEST_ENV = "AC2_TEST_PROFILE_TEST"


class CompileClock:
    """Seconds JAX spent compiling in this process since `install()`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.cache = {"hit": 0, "miss": 0}  # persistent compilation cache answers

    def install(self) -> None:
        import jax.monitoring

        def listener(event: str, duration: float, **_: object) -> None:
            if event in COMPILE_EVENTS:
                self.seconds += duration

        def cache_listener(event: str, **_: object) -> None:
            if event in CACHE_EVENTS:
                self.cache[CACHE_EVENTS[event]] += 1

        jax.monitoring.register_event_duration_secs_listener(listener)
        jax.monitoring.register_event_listener(cache_listener)


_OUTCOMES = pytest.StashKey[list]()


class ProfilePlugin:
    """pytest plugin: one JSON line per test (wall and compile seconds)."""

    def __init__(self, out_dir: str) -> None:
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.clock = CompileClock()
        self.clock.install()
        self.path = self.out / f"tests-{os.getpid()}.jsonl"

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        os.environ[TEST_ENV] = item.nodeid
        item.stash[_OUTCOMES] = []
        t0, c0 = time.perf_counter(), self.clock.seconds
        h0, m0 = self.clock.cache["hit"], self.clock.cache["miss"]
        cpu0 = _cpu_seconds()
        yield
        wall, compile_s = time.perf_counter() - t0, self.clock.seconds - c0
        cpu = _cpu_seconds() - cpu0
        hits, misses = self.clock.cache["hit"] - h0, self.clock.cache["miss"] - m0
        os.environ.pop(TEST_ENV, None)
        outcomes = item.stash[_OUTCOMES]
        outcome = next((o for o in ("failed", "skipped") if o in outcomes), "passed")
        line = {
            "test": item.nodeid,
            "wall_s": wall,
            "compile_s": compile_s,
            "outcome": outcome,
            "cache_hits": hits,
            "cache_misses": misses,
            "cpu_s": cpu,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = (yield).get_result()
        item.stash[_OUTCOMES].append(report.outcome)


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process (all threads) and its waited-for
    children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


# ---------------------------------------------------------------- the report


def load(out_dir: str) -> dict[str, dict]:
    """Per test: wall_s, compile_s (in-process + its subprocesses), outcome,
    cache_hits and cache_misses (in-process + subprocesses)."""
    tests: dict[str, dict] = {}
    for path in sorted(Path(out_dir).glob("tests-*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            tests[rec["test"]] = {
                "cache_hits": 0, "cache_misses": 0, "cpu_s": None, **rec, "sub_compile_s": 0.0
            }  # fmt: skip
    for path in sorted(Path(out_dir).glob("sub-*.json*")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line torn by SIGKILL
                continue
            if rec.get("test") in tests:
                if "cache" in rec:
                    key = "cache_hits" if rec["cache"] == "hit" else "cache_misses"
                    tests[rec["test"]][key] += 1
                else:
                    tests[rec["test"]]["sub_compile_s"] += rec["compile_s"]
    return tests


def report(out_dir: str, top: int = 50) -> str:
    tests = load(out_dir)
    if not tests:
        return f"no test records under {out_dir}"
    modules: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0, 0, 0.0])
    for nodeid, rec in tests.items():
        m = modules[nodeid.split("::")[0]]
        m[0] += 1
        m[1] += rec["wall_s"]
        m[2] += rec["compile_s"]
        m[3] += rec["sub_compile_s"]
        m[4] += rec["cache_hits"]
        m[5] += rec["cache_misses"]
        m[6] += _idle(rec)
    total_wall = sum(m[1] for m in modules.values())
    total_in = sum(m[2] for m in modules.values())
    total_sub = sum(m[3] for m in modules.values())
    total_hits = sum(m[4] for m in modules.values())
    total_lookups = total_hits + sum(m[5] for m in modules.values())
    total_idle = sum(m[6] for m in modules.values())
    lines = [
        f"{len(tests)} tests, {total_wall:.0f} s summed over tests; JAX compile: "
        f"{total_in:.0f} s in the pytest process(es) ({100 * total_in / total_wall:.0f}%), "
        f"{total_sub:.0f} s in subprocesses; persistent compilation cache: {total_hits} hits "
        f"of {total_lookups} ({_share(total_hits, total_lookups)}); idle (wall on no CPU): "
        f"{total_idle:.0f} s",
        "",
        f"{'module':<64} {'tests':>5} {'wall_s':>8} {'share':>6} {'compile_s':>9} "
        f"{'cmp%':>5} {'sub_cmp_s':>9} {'hits':>5} {'misses':>6} {'hit%':>5} {'idle_s':>7}",
    ]
    for name, (n, wall, comp, sub, hits, misses, idle) in sorted(
        modules.items(), key=lambda kv: -kv[1][1]
    ):
        lines.append(
            f"{name:<64} {n:>5} {wall:>8.1f} {100 * wall / total_wall:>5.1f}% {comp:>9.1f} "
            f"{100 * comp / max(wall, 1e-9):>4.0f}% {sub:>9.1f} {hits:>5} {misses:>6} "
            f"{_share(hits, hits + misses):>5} {idle:>7.1f}"
        )
    lines += [
        "",
        f"The {top} slowest tests:",
        f"{'wall_s':>8} {'compile_s':>9} {'cmp%':>5} {'sub_cmp_s':>9} {'idle_s':>7}  test",
    ]
    slowest = sorted(tests.items(), key=lambda kv: -kv[1]["wall_s"])[:top]
    for nodeid, rec in slowest:
        lines.append(
            f"{rec['wall_s']:>8.1f} {rec['compile_s']:>9.1f} "
            f"{100 * rec['compile_s'] / max(rec['wall_s'], 1e-9):>4.0f}% "
            f"{rec['sub_compile_s']:>9.1f} {_idle(rec):>7.1f}  {nodeid}"
        )
    top_wall = sum(rec["wall_s"] for _, rec in slowest)
    lines.append(
        f"(the {len(slowest)} slowest: {top_wall:.0f} s, "
        f"{100 * top_wall / total_wall:.0f}% of the summed time)"
    )
    return "\n".join(lines)


def _idle(rec: dict) -> float:
    """Wall seconds the test spent on no CPU (0 for records without cpu_s)."""
    cpu = rec.get("cpu_s")
    return 0.0 if cpu is None else max(0.0, rec["wall_s"] - cpu)


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--top", type=int, default=50)
    args = parser.parse_args()
    print(report(args.dir, args.top))
    sys.exit(0)
