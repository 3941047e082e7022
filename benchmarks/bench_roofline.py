"""This machine's fp32 GEMM ceiling: [n, n] @ [n, n] GFLOP/s at a few sizes, per library.

XLA (jit) is the practical roofline bench_train_step compares to. `--libraries`
adds numpy's BLAS (OpenBLAS in the wheels) and torch (MKL / oneDNN): the best
rate of any library at any size bounds what a train step of the same FLOPs can
reach here, so a goal above it is out of reach by any kernel choice. XLA runs
first: OpenBLAS's idle threads spin on the cores after a call and slow what
follows (docs/notes/2026-12-06-openblas-inside-xla-cpu.md).

    python -m benchmarks.bench_roofline --sizes 256,512,1024,2048 --libraries xla,numpy,torch
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import parser, print_table, write_json  # noqa: E402

LIBRARIES = ("xla", "numpy", "torch")


def _operands(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(n)
    return (rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32))


def gemm_call(library: str, a: np.ndarray, b: np.ndarray) -> Callable[[], np.ndarray]:
    """A blocking call of `library`'s fp32 a @ b; the call returns the product as numpy."""
    if library == "xla":
        f, ja, jb = jax.jit(lambda x, y: x @ y), jnp.asarray(a), jnp.asarray(b)
        return lambda: np.asarray(f(ja, jb).block_until_ready())
    if library == "numpy":
        return lambda: a @ b
    if library == "torch":
        import torch

        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        return lambda: (ta @ tb).numpy()
    raise ValueError(f"bench_roofline: library must be one of {LIBRARIES}, got {library!r}")


def _rate(call: Callable[[], object], n: int, min_seconds: float) -> dict:
    call()  # compile / warm up
    iters, start = 0, time.perf_counter()
    while True:
        call()
        iters += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and iters >= 3:
            break
    seconds = elapsed / iters
    return {"n": n, "ms": seconds * 1e3, "gflops": 2.0 * n**3 / seconds / 1e9, "calls": iters}


def matmul_gflops(n: int, min_seconds: float = 1.0, library: str = "xla") -> dict:
    """Times `library`'s fp32 [n, n] @ [n, n] for at least `min_seconds` (>= 3 calls)."""
    a, b = _operands(n)
    return {"library": library, **_rate(gemm_call(library, a, b), n, min_seconds)}


def gemm_ceiling(sizes, libraries=LIBRARIES, min_seconds: float = 1.0) -> dict:
    """Every library's rate per size (in the order given) and the best of all:
    {"rows", "ceiling_gflops", "ceiling_by": (library, n)}."""
    rows = [matmul_gflops(n, min_seconds, lib) for lib in libraries for n in sizes]
    best = max(rows, key=lambda r: r["gflops"])
    return {"rows": rows, "ceiling_gflops": best["gflops"],
            "ceiling_by": (best["library"], best["n"])}


def roofline(sizes=(256, 512, 1024, 2048), min_seconds: float = 1.0) -> dict:
    """XLA's rate per size and its best (`peak_gflops`): the ceiling of XLA alone."""
    c = gemm_ceiling(sizes, ("xla",), min_seconds)
    return {"rows": c["rows"], "peak_gflops": c["ceiling_gflops"]}


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256,512,1024,2048")
    p.add_argument("--libraries", default="xla", help=f"comma list of {','.join(LIBRARIES)}")
    p.add_argument("--min_seconds", type=float, default=1.0)
    args = p.parse_args(argv)
    libs = tuple(args.libraries.split(","))
    result = gemm_ceiling([int(n) for n in args.sizes.split(",")], libs, args.min_seconds)
    print_table(result["rows"], ["library", "n", "ms", "gflops", "calls"])
    lib, n = result["ceiling_by"]
    print(f"ceiling: {result['ceiling_gflops']:.1f} GFLOP/s (fp32, {lib} at n = {n}; "
          f"{jax.default_backend()})")
    write_json(args.out, {"benchmark": "roofline", **result})
    return result


if __name__ == "__main__":
    main()
