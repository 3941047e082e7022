"""Would bf16 weights bring decode to 3x `generate`? The decode step's GEMMs in fp32
and bf16, XLA:CPU against torch, at batch 16 and 64.

    python -m benchmarks.bench_decode_gemm_dtype --batches 16,64 --rounds 5

The GEMMs of one decode step of bench_sampler's model (hidden 256, 4 layers, 8 heads
of 32, 4 KV heads, MLP 768, untied 4,096-token head): per layer q, k, v, o, gate, up,
down, then the head; M = the batch. Each is timed by bench_matmul_ceiling's
`time_gemm` (XLA and torch alternating, batches of calls >= `--batch_ms`, torch on
`--threads`) in each dtype; reported: the per-call medians summed over the step.
XLA's per-call dispatch counts against it (an upper bound on its in-step time), so
read the bf16 / fp32 ratio of each library.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.bench_matmul_ceiling import Gemm, time_gemm  # noqa: E402
from benchmarks.common import parser, print_table, write_json  # noqa: E402


def step_gemms(batch: int, hidden=256, layers=4, heads=8, kv_heads=4, mlp=768,
               vocab=4096) -> list[Gemm]:
    """One decode step's GEMMs at M = batch (equal shapes merged into one count)."""
    hd = hidden // heads
    per_layer = [(hidden, heads * hd), (hidden, kv_heads * hd), (hidden, kv_heads * hd),
                 (heads * hd, hidden), (hidden, mlp), (hidden, mlp), (mlp, hidden)]
    counts: dict[tuple[int, int], int] = {}
    for k, n in per_layer:
        counts[(k, n)] = counts.get((k, n), 0) + layers
    counts[(hidden, vocab)] = counts.get((hidden, vocab), 0) + 1
    return [Gemm(f"{k}x{n}", batch, k, n, count=c) for (k, n), c in counts.items()]


def measure(batch: int, dtype: str, rounds: int, batch_ms: float, threads: int) -> dict:
    import torch
    torch.set_num_threads(threads)
    total = {"xla_us": 0.0, "torch_us": 0.0}
    for g in step_gemms(batch):
        r = time_gemm(g, rounds, batch_ms, dtype=dtype)
        total["xla_us"] += g.count * r["xla_median_ms"] * 1e3
        total["torch_us"] += g.count * r["torch_median_ms"] * 1e3
    return {"batch": batch, "dtype": dtype, **total}


def main(argv=None) -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--batches", default="16,64")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch_ms", type=float, default=20.0)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args(argv)
    rows = [measure(int(b), dt, args.rounds, args.batch_ms, args.threads)
            for b in args.batches.split(",") for dt in ("float32", "bfloat16")]
    for r in rows:
        f32 = next(x for x in rows if x["batch"] == r["batch"] and x["dtype"] == "float32")
        r["xla_bf16_over_fp32"] = r["xla_us"] / f32["xla_us"]
        r["torch_bf16_over_fp32"] = r["torch_us"] / f32["torch_us"]
    print_table(rows, ["batch", "dtype", "xla_us", "torch_us", "xla_bf16_over_fp32",
                       "torch_bf16_over_fp32"])
    write_json(args.out, {"rows": rows})


if __name__ == "__main__":
    main()
