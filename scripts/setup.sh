#!/usr/bin/env bash
# Creates .venv (if missing) and installs ac2_jax into it.
#   scripts/setup.sh        core install
#   scripts/setup.sh dev    core + [dev] (pytest, torch CPU, transformers)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
if [ "${1:-}" = "dev" ]; then
  # CPU torch pinned first so the [dev] extra never pulls a CUDA build.
  python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
  python -m pip install -q -e ".[dev]" 2>&1 | grep -v "is ignored" || true
else
  python -m pip install -q -e . 2>&1 | grep -v "is ignored" || true
fi
python -c "import ac2_jax, jax, flax, optax, orbax.checkpoint" \
  || { echo "setup.sh: install failed" >&2; exit 1; }
