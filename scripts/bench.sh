#!/usr/bin/env bash
# Runs the side-by-side CPU benchmarks that need no checkpoint; JSON results go to bench_results/
# Needs the [dev] extra (torch + transformers are the peers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
. .venv/bin/activate
export JAX_PLATFORMS=cpu
OUT=${OUT:-bench_results}
mkdir -p "$OUT"
# The CPU benchmarks that run unattended in minutes, by their `python -m benchmarks`
# names (the list: `python -m benchmarks`; real_size, lora, fault_soak and gpu take
# longer or need a checkpoint or an accelerator: run them by hand, docs/results.md).
for b in roofline merge_savings packing train_step matmul_ceiling sampler endpoint weight_publish; do
  echo "== $b"
  python -m benchmarks "$b" --out "$OUT/$b.json"
done
