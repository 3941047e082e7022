"""Padding waste: pack_segments (first-fit decreasing) vs one segment per row.

Length mix (stated, synthetic, long-tailed like agent traces): lognormal
with median `--median` tokens and sigma `--sigma`, clipped to [16, seq_len];
`--n` segments. Naive = every segment padded to seq_len in its own row;
naive-batch-max = padded to the longest segment of the batch.

    python -m benchmarks.bench_packing --out bench_results/packing.json
"""

from __future__ import annotations

import time

import numpy as np

from ac2_jax.segments import Segment, pack_segments
from benchmarks.common import parser, print_table, write_json


def main():
    p = parser(__doc__)
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--median", type=float, default=600)
    p.add_argument("--sigma", type=float, default=0.9)
    p.add_argument("--seq_lens", default="2048,4096,8192")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for seq_len in map(int, args.seq_lens.split(",")):
        lengths = np.clip(rng.lognormal(np.log(args.median), args.sigma, args.n), 16, seq_len)
        lengths = lengths.astype(int)
        segs = [Segment(np.ones(n, np.int32), np.ones(n), task=f"t{i % 64}")
                for i, n in enumerate(lengths)]
        t0 = time.perf_counter()
        b = pack_segments(segs, seq_len)
        t_pack = time.perf_counter() - t0
        real = int(lengths.sum())
        rows.append({
            "seq_len": seq_len, "segments": args.n, "real_tokens": real,
            "ffd_rows": b.shape[0], "ffd_waste": 1 - real / (b.shape[0] * seq_len),
            "naive_rows": args.n, "naive_waste": 1 - real / (args.n * seq_len),
            "batchmax_waste": 1 - real / (args.n * int(lengths.max())),
            "compute_saving_vs_naive": (args.n * seq_len) / (b.shape[0] * seq_len),
            "pack_ms": 1000 * t_pack})
    print(f"length mix: lognormal(median={args.median}, sigma={args.sigma}), clipped [16, seq_len]")
    print_table(rows, ["seq_len", "segments", "real_tokens", "ffd_rows", "ffd_waste", "naive_rows",
                       "naive_waste", "batchmax_waste", "compute_saving_vs_naive", "pack_ms"])
    write_json(args.out, {"benchmark": "packing", "config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
