#!/usr/bin/env bash
# The main job end to end on CPU: a tiny agent learns to use a calculator tool.
# Installs into .venv first, then SFT warm start -> eval -> task-level RL
# through the OpenAI-compatible endpoint -> eval -> report folder.
#   scripts/demo.sh [--config.rl.steps=20 ...]   (extra flags go to python -m experiments.calculator)
#   scripts/demo.sh long [flags ...]   the long-horizon compacting agent (issue 18):
#     chain tasks, a compactor whose memo must carry the running value, async RL
#     on every episode of every trace (config variant experiments/calculator/config.py:long)
set -euo pipefail
cd "$(dirname "$0")/.."
VARIANT=""
if [[ "${1:-}" == "long" || "${1:-}" == "long_quick" ]]; then
  VARIANT=":$1"
  shift
fi
bash scripts/setup.sh
. .venv/bin/activate
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
if [[ -n "$VARIANT" ]]; then
  WORKDIR=${WORKDIR:-runs/calculator_long}
else
  WORKDIR=${WORKDIR:-runs/calculator}
fi
python -m experiments.calculator --config=experiments/calculator/config.py"$VARIANT" \
  --config.workdir="$WORKDIR" "$@"
echo "Report: $WORKDIR/report (report.json, learning_curve.png, trace_*.html, final_hf/)"
