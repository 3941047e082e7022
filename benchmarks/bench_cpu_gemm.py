"""OpenBLAS inside XLA:CPU: does a GEMM custom call close the train step's gap to torch?

Issue 41: on the AVX-512 EPYC, XLA:CPU's own GEMMs are slower than torch's at the train
step's shapes (bench_matmul_ceiling), so the step cannot reach 1.5x torch by anything
outside the GEMMs. `benchmarks/cpu_gemm` is an XLA FFI custom call that computes a float32
GEMM with the OpenBLAS numpy ships. This times, side by side in one process and alternately:
- every plain (non-batched) GEMM of bench_train_step's step: XLA's dot_general, the custom
  call (both jitted) and torch.matmul, as bench_matmul_ceiling does;
- the whole step three ways: ours as it is, ours with the attention projections and the
  SwiGLU MLP's products (forward and backward) through the custom call (the tied lm head
  and the attention's batched products stay XLA's), and transformers + torch.

    python -m benchmarks.bench_cpu_gemm --sizes small,medium --rounds 8

The custom call is an experiment in benchmarks/, not the library's: it is adopted only if it
wins side by side on both kinds of CPU (BUILD_NOTES, issue 41).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import cpu_gemm  # noqa: E402
from benchmarks.bench_matmul_ceiling import _batch_seconds, _jax_fn, _torch_fn, step_gemms  # noqa: E402
from benchmarks.bench_train_step import SIZES, config_of, jax_setup, torch_setup  # noqa: E402
from benchmarks.common import parser, print_table, write_json  # noqa: E402


def _blas_fn(g):
    return jax.jit(lambda a, b: cpu_gemm.gemm(a, b, trans_a=g.lhs_t, trans_b=g.rhs_t))


def time_gemm3(g, rounds: int, batch_ms: float, seed: int = 0) -> dict:
    """Per-call ms (min over `rounds` alternating batches) of XLA, the custom call and
    torch on one plain GEMM, and the custom call's largest |difference| from XLA's."""
    import torch

    rng = np.random.default_rng(seed)
    a_np, b_np = (rng.standard_normal(s, dtype=np.float32) for s in g.shapes())
    ja, jb = jax.device_put(a_np), jax.device_put(b_np)
    ta, tb = torch.from_numpy(a_np), torch.from_numpy(b_np)
    xf, bf, tf = _jax_fn(g), _blas_fn(g), _torch_fn(g)
    diff = float(np.max(np.abs(np.asarray(xf(ja, jb)) - np.asarray(bf(ja, jb)))))
    sides = {"xla": (lambda: xf(ja, jb), jax.block_until_ready),
             "blas": (lambda: bf(ja, jb), jax.block_until_ready),
             "torch": (lambda: tf(ta, tb), lambda o: None)}
    with torch.no_grad():
        calls = {s: max(1, math.ceil(batch_ms / 1e3 / max(_batch_seconds(c, b, 1), 1e-6)))
                 for s, (c, b) in sides.items()}
        times = {s: [] for s in sides}
        for _ in range(rounds):
            for s, (c, b) in sides.items():
                times[s].append(_batch_seconds(c, b, calls[s]))
    out = {"gemm": g.name, "shape": f"{g.m}x{g.k}x{g.n}", "count": g.count,
           "blas_max_abs_diff": diff}
    for s in sides:
        out[f"{s}_ms"] = min(times[s]) * 1e3
        out[f"{s}_gflops"] = g.flops / min(times[s]) / 1e9
    return out


def _swiglu_blas(x, wg, wu, wd):
    g, u = cpu_gemm.matmul(x, wg), cpu_gemm.matmul(x, wu)
    return cpu_gemm.matmul(jax.nn.silu(g) * u, wd)


@contextlib.contextmanager
def blas_projections():
    """While open, models.layers' projections (`linear`) and SwiGLU MLP (`swiglu`) run
    through the custom call; a step first called inside keeps it (jit traces once)."""
    from ac2_jax.models import layers
    saved = layers.linear, layers.swiglu
    layers.linear, layers.swiglu = cpu_gemm.matmul, _swiglu_blas
    try:
        yield
    finally:
        layers.linear, layers.swiglu = saved


def time_steps3(size: str, rounds: int) -> dict:
    """Three steps built first, then timed alternately: ours, ours with the custom call,
    torch's. Also the first step's loss of both of ours (the same math, fp32)."""
    c, (_, rows, seq_len) = config_of(size), SIZES[size]
    runs = {}
    for name in ("xla", "blas"):
        ctx = blas_projections() if name == "blas" else contextlib.nullcontext()
        with ctx:
            step, state, batch = jax_setup(c, rows, seq_len)
            state, m = step(state, batch)  # traced and compiled here
            runs[name] = [step, state, batch, float(m["loss"])]
    torch_one = torch_setup(c, rows, seq_len)
    torch_one()

    def ours(name):
        def go():
            r = runs[name]
            r[1], m = r[0](r[1], r[2])
            jax.block_until_ready(m)
        return go

    fns = {"xla": ours("xla"), "blas": ours("blas"), "torch": torch_one}
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    out = {f"{k}_step_{stat}_s": f(ts) for k, ts in times.items()
           for stat, f in (("min", min), ("median", statistics.median))}
    out["first_loss_xla"], out["first_loss_blas"] = runs["xla"][3], runs["blas"][3]
    return out


def main(argv=None):
    import torch

    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default="small,medium")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--batch_ms", type=float, default=20.0)
    p.add_argument("--torch_threads", type=int, default=os.cpu_count())
    p.add_argument("--no_steps", action="store_true", help="GEMMs only")
    args = p.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    so = cpu_gemm.build()
    results = []
    for size in args.sizes.split(","):
        if size not in SIZES:
            raise SystemExit(f"unknown size {size!r}; choose from {sorted(SIZES)}")
        gemms = [time_gemm3(g, args.rounds, args.batch_ms) for g in step_gemms(size)
                 if not g.batch]
        r = {"size": size, "gemms": gemms}
        for s in ("xla", "blas", "torch"):
            r[f"{s}_plain_matmuls_s"] = sum(x[f"{s}_ms"] * x["count"] for x in gemms) / 1e3
        print(f"\n{size}: plain GEMMs (ms per call, min of {args.rounds}; count = per step)")
        print_table(gemms, ["gemm", "shape", "count", "xla_ms", "blas_ms", "torch_ms",
                            "xla_gflops", "blas_gflops", "torch_gflops", "blas_max_abs_diff"])
        print(f"{size}: the step's plain matmuls: XLA {r['xla_plain_matmuls_s'] * 1e3:.1f} ms, "
              f"custom call {r['blas_plain_matmuls_s'] * 1e3:.1f} ms, torch "
              f"{r['torch_plain_matmuls_s'] * 1e3:.1f} ms")
        if not args.no_steps:
            r.update(time_steps3(size, args.rounds))
            print(f"{size}: whole step (min of {args.rounds}): XLA "
                  f"{r['xla_step_min_s'] * 1e3:.1f} ms, with the custom call "
                  f"{r['blas_step_min_s'] * 1e3:.1f} ms, torch {r['torch_step_min_s'] * 1e3:.1f} "
                  f"ms; torch / ours: {r['torch_step_min_s'] / r['xla_step_min_s']:.2f}x as is, "
                  f"{r['torch_step_min_s'] / r['blas_step_min_s']:.2f}x with the custom call "
                  f"(first losses {r['first_loss_xla']:.6f} / {r['first_loss_blas']:.6f})")
        results.append(r)
    write_json(args.out, {"benchmark": "cpu_gemm", "library": os.path.basename(so),
                          "rounds": args.rounds,
                          "torch_threads": args.torch_threads, "results": results})
    return results


if __name__ == "__main__":
    main()
