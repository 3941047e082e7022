#!/usr/bin/env bash
# Installs everything (.venv, .[dev]) and runs the test suite on CPU.
# Multi-device tests use 8 forced host devices (set in tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
. .venv/bin/activate
export JAX_PLATFORMS=cpu
python -m pytest -q -p no:cacheprovider tests "$@"
