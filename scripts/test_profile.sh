#!/usr/bin/env bash
# Where the suite's time goes: runs pytest (arguments as for pytest; default: tests)
# with tests/support/suite_profile.py's plugin and prints, per test module and for the 50
# slowest tests, wall time and the seconds JAX spent compiling (in the pytest
# process and in the Python subprocesses tests start). The records stay in
# $AC2_TEST_PROFILE (default: a new temporary directory, printed at the end).
#   scripts/test_profile.sh                         the whole suite
#   scripts/test_profile.sh tests/losses -n 2       a folder, with pytest-xdist
#   python -m tests.support.suite_profile DIR --top 100     the report again, from the records
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh dev
. .venv/bin/activate
export JAX_PLATFORMS=cpu
unset PYTHONDONTWRITEBYTECODE  # as scripts/test.sh
export AC2_TEST_PROFILE=${AC2_TEST_PROFILE:-$(mktemp -d -t ac2-test-profile.XXXXXX)}
export PYTHONPATH="$PWD/tests/support/suite_profile_site${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)
python -m pytest -q -p no:cacheprovider "${@:-tests}"
rc=$?
echo "pytest exit status $rc, $(( $(date +%s) - start )) s wall"
python -m tests.support.suite_profile "$AC2_TEST_PROFILE" --top 50
echo "records: $AC2_TEST_PROFILE"
exit $rc
