#!/usr/bin/env bash
# The pinapple experiment (self-distillation of a spelling hint), CPU, a few minutes.
# Extra flags go to absl, e.g. --config.seeds="(0,1,2,3,4)" --config.workdir=runs/pinapple2
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .venv/bin/activate ]; then . .venv/bin/activate; fi
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
python -m experiments.pinapple --config=experiments/pinapple/config.py "$@"
