#!/usr/bin/env bash
# GPU benchmark on one accelerator (sized for an H200: <= 6 minutes), offline:
# bf16 train-step MFU of a ~0.5B Qwen3-shaped decoder and JaxSampler decode
# tokens/s at batch 1 and 64. Uses the python that already has jax (CUDA),
# flax, optax and orbax-checkpoint; installs and downloads nothing (the repo
# goes on PYTHONPATH). Results: $RESULTS/gpu_bench.json (RESULTS defaults to
# $OUT if set, else bench_results). Extra flags go to benchmarks/gpu_bench.py
# (e.g. --smoke for a CPU check, --vocab 32768, --skip decode).
# Real-size presets (experiments/real_size/qwen3.py): PRESETS="0.6b_gpu 1.7b_gpu" runs
# benchmarks/gpu_bench.py --preset P for each after the default run (bf16 MFU, chunked-loss
# memory, the attention backend in use, decode tok/s; needs ml_collections); PRESETS="" skips them.
#   scripts/gpu_bench.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RESULTS=${RESULTS:-${OUT:-bench_results}}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
"$PY" -c "import jax, flax, optax, orbax.checkpoint; print('jax', jax.__version__, jax.devices())"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm \
  --format=csv || true
# The script saves its JSON after every section; the timeout keeps the run bounded.
timeout "${TIMEOUT_S:-360}" "$PY" -m benchmarks.gpu_bench --out "$RESULTS/gpu_bench.json" "$@" \
  2>&1 | tee "$RESULTS/gpu_bench.log"
for P in ${PRESETS-0.6b_gpu}; do
  timeout "${TIMEOUT_S:-360}" "$PY" -m benchmarks.gpu_bench --preset "$P" --skip matmul \
    --out "$RESULTS/gpu_bench_$P.json" "$@" 2>&1 | tee "$RESULTS/gpu_bench_$P.log"
done
