"""Would bf16 weights bring decode to 3x `generate`? The decode step's GEMMs in fp32
and bf16, XLA:CPU against torch, at batch 16 and 64.

    python -m benchmarks.bench_decode_gemm_dtype --batches 16,64 --rounds 5

The GEMMs of one decode step of bench_sampler's model (hidden 256, 4 layers, 8 heads
of 32, 4 KV heads, MLP 768, untied 4,096-token head): per layer q, k, v, o, gate, up,
down, then the head; M = the batch. Each GEMM is a jitted `jnp.dot` (fp32
accumulation) and `torch.matmul` (same threads), timed in batches of calls
(>= `--batch_ms`), the two libraries alternating; the per-call median of `--rounds`
batches, summed over the step. XLA's per-call dispatch counts against it (an upper
bound on its in-step time), so read the bf16 / fp32 ratio of each library.
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import parser, print_table, write_json  # noqa: E402


def step_gemms(hidden=256, layers=4, heads=8, kv_heads=4, mlp=768, vocab=4096):
    """(K, N, count) of one decode step's GEMMs."""
    hd = hidden // heads
    per_layer = [(hidden, heads * hd), (hidden, kv_heads * hd), (hidden, kv_heads * hd),
                 (heads * hd, hidden), (hidden, mlp), (hidden, mlp), (mlp, hidden)]
    out = {}
    for k, n in per_layer:
        out[(k, n)] = out.get((k, n), 0) + layers
    out[(hidden, vocab)] = out.get((hidden, vocab), 0) + 1
    return [(k, n, c) for (k, n), c in out.items()]


def _per_call(fn, batch_ms: float) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while (time.perf_counter() - t0) * 1e3 < batch_ms or n < 3:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def measure(batch: int, dtype: str, rounds: int, batch_ms: float, threads: int) -> dict:
    import torch
    torch.set_num_threads(threads)
    jdt, tdt = {"float32": (jnp.float32, torch.float32),
                "bfloat16": (jnp.bfloat16, torch.bfloat16)}[dtype]
    dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    total = {"xla_us": 0.0, "torch_us": 0.0}
    for k, n, count in step_gemms():
        a, b = jnp.ones((batch, k), jdt), jnp.ones((k, n), jdt)
        ta, tb = torch.ones(batch, k, dtype=tdt), torch.ones(k, n, dtype=tdt)
        xs, ts = [], []
        for _ in range(rounds):  # alternating
            xs.append(_per_call(lambda: dot(a, b).block_until_ready(), batch_ms))
            ts.append(_per_call(lambda: torch.matmul(ta, tb), batch_ms))
        total["xla_us"] += count * statistics.median(xs) * 1e6
        total["torch_us"] += count * statistics.median(ts) * 1e6
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
