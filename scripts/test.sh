#!/usr/bin/env bash
# Installs everything (.venv, .[dev]), lints and type-checks ac2_jax/ (ruff check,
# ruff format --check, mypy: zero findings, settings in pyproject.toml) and runs the
# test suite on CPU. Multi-device tests use 8 forced host devices (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
. .venv/bin/activate
export JAX_PLATFORMS=cpu
ruff check ac2_jax
ruff format --check ac2_jax
mypy ac2_jax
python -m pytest -q -p no:cacheprovider --durations=30 tests "$@"
