#!/usr/bin/env bash
# Runs every side-by-side benchmark (CPU); JSON results go to bench_results/.
# Needs the [dev] extra (torch + transformers are the peers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
. .venv/bin/activate
export JAX_PLATFORMS=cpu
OUT=${OUT:-bench_results}
mkdir -p "$OUT"
for b in roofline merge_savings packing train_step matmul_ceiling sampler endpoint weight_publish tree_packing; do
  if [ -f "benchmarks/bench_$b.py" ]; then
    echo "== bench_$b"
    python -m "benchmarks.bench_$b" --out "$OUT/$b.json"
  fi
done
