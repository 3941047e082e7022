"""XLA matmul rate of this machine: fp32 jitted [n, n] @ [n, n] GFLOP/s at a few sizes.

The best rate is the practical roofline that bench_train_step compares to.

    python -m benchmarks.bench_roofline --sizes 256,512,1024,2048 --out bench_results/roofline.json
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import parser, print_table, write_json  # noqa: E402


def matmul_gflops(n: int, min_seconds: float = 1.0) -> dict:
    """Times jit(a @ b) for fp32 [n, n] operands for at least `min_seconds` (>= 3 calls)."""
    ka, kb = jax.random.split(jax.random.PRNGKey(n))
    a = jax.random.normal(ka, (n, n), jnp.float32)
    b = jax.random.normal(kb, (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()  # compile + warm up
    iters, start = 0, time.perf_counter()
    while True:
        f(a, b).block_until_ready()
        iters += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and iters >= 3:
            break
    seconds = elapsed / iters
    return {"n": n, "ms": seconds * 1e3, "gflops": 2.0 * n**3 / seconds / 1e9, "calls": iters}


def roofline(sizes=(256, 512, 1024, 2048), min_seconds: float = 1.0) -> dict:
    rows = [matmul_gflops(n, min_seconds) for n in sizes]
    return {"rows": rows, "peak_gflops": max(r["gflops"] for r in rows)}


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256,512,1024,2048")
    p.add_argument("--min_seconds", type=float, default=1.0)
    args = p.parse_args(argv)
    result = roofline([int(n) for n in args.sizes.split(",")], args.min_seconds)
    print_table(result["rows"], ["n", "ms", "gflops", "calls"])
    print(f"peak: {result['peak_gflops']:.1f} GFLOP/s (fp32 matmul, {jax.default_backend()})")
    write_json(args.out, {"benchmark": "roofline", **result})
    return result


if __name__ == "__main__":
    main()
