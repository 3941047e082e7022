#!/usr/bin/env bash
# The main job end to end on CPU: a tiny agent learns to use a calculator tool.
# Installs into .venv first, then SFT warm start -> eval -> task-level RL
# through the OpenAI-compatible endpoint -> eval -> report folder.
#   scripts/demo.sh [--config.rl.steps=20 ...]   (extra flags go to train_agent.py)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
WORKDIR=${WORKDIR:-runs/calculator}
python experiments/train_agent.py --config=experiments/configs/calculator.py \
  --config.workdir="$WORKDIR" "$@"
echo "Report: $WORKDIR/report (report.json, learning_curve.png, trace_*.html, final_hf/)"
