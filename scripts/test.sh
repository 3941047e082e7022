#!/usr/bin/env bash
# Installs everything (.venv, .[dev]; kept when setup.py and pyproject.toml are unchanged),
# lints the whole tree (ruff check .), checks ac2_jax/'s format and types (ruff format
# --check, mypy: zero findings, settings in pyproject.toml; mypy runs beside the tests;
# .pre-commit-config.yaml runs the same three before a commit) and runs the
# test suite on CPU, in 2 pytest-xdist workers (whole files per worker), with one JAX
# compilation cache for the run (tests/conftest.py). Prints the total and the 30
# slowest tests.
#   scripts/test.sh            every test (CI runs this; budget: 20 minutes on 2 cores)
#   scripts/test.sh --quick    the inner loop: unit and contract tests, no pipelines,
#                              notebooks, docs build, multi-process or fault tests
#                              (`-m "not full"`, tests/conftest.py FULL_ONLY; about 6.5
#                              minutes on 2 cores, 4 once its kept compilation cache is warm;
#                              goal 5: docs/notes/2026-12-08-suite-in-20-minutes-seventh-session.md)
#   scripts/test.sh ARGS...    extra pytest arguments (a path, -k, -x), after the tier flag
# AC2_TEST_WORKERS=N sets the number of workers (0: one process, no xdist).
# Where the time goes: scripts/test_profile.sh (CONTRIBUTING.md, "Tests").
set -euo pipefail
cd "$(dirname "$0")/.."
tier=()
if [ "${1:-}" = "--quick" ]; then
  tier=(-m "not full")
  shift
  # The inner loop keeps its JAX compilation cache between runs (.cache/jax-quick,
  # git-ignored; delete it to reclaim the space): a program whose code and shapes did not
  # change since the last run is read back, not compiled. No size limit: JAX's LRU mode
  # (JAX_COMPILATION_CACHE_MAX_SIZE) locks and scans the folder on every write, and a
  # quick run took 850 s with it against about 370 s. The full run (CI's) compiles afresh
  # into a cache of its own run (tests/conftest.py).
  export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$PWD/.cache/jax-quick}
fi
bash scripts/setup.sh dev
. .venv/bin/activate
export JAX_PLATFORMS=cpu
# Bytecode is written (__pycache__, git-ignored) even where the machine sets
# PYTHONDONTWRITEBYTECODE: each pytest worker and each child process would otherwise
# compile every module of the library and the tests from source (27 -> 20 CPU s per
# worker's collection; docs/notes/2026-12-07-suite-in-20-minutes-fifth-session.md).
unset PYTHONDONTWRITEBYTECODE
ruff check .
ruff format --check ac2_jax
# mypy (27 CPU s from a fresh clone) runs beside the tests, niced: it takes the CPU the
# tests leave idle (tests waiting on servers and children) instead of adding its time
# in front of them. Its report and status come after pytest's; either failing fails.
mypy_log=$(mktemp)
nice -n 10 mypy ac2_jax >"$mypy_log" 2>&1 &
mypy_pid=$!
workers=${AC2_TEST_WORKERS:-2}
xdist=()
if [ "$workers" != 0 ]; then
  xdist=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
paths=(tests)
for a in "$@"; do
  case "$a" in tests*) paths=() ;; esac
done
start=$(date +%s)
status=0
python -m pytest -q -p no:cacheprovider --durations=30 "${xdist[@]}" "${tier[@]}" \
  "${paths[@]}" "$@" || status=$?
echo "scripts/test.sh: pytest took $(( $(date +%s) - start )) s"
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
echo "mypy ac2_jax: $(tail -n 1 "$mypy_log")"
if [ "$mypy_status" != 0 ]; then
  cat "$mypy_log"
fi
rm -f "$mypy_log"
if [ "$status" != 0 ]; then
  exit "$status"
fi
exit "$mypy_status"
