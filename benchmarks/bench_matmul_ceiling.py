"""The matmul ceiling of the train step: XLA:CPU's GEMMs vs torch's at the step's exact shapes.

Issue 16 asks for a train step >= 1.5x transformers + torch's tokens/s. About
half of our step is matmul (the profiles in docs/notes/2026-12-02-where-the-step-time-goes-profiles.md), so if XLA:CPU's GEMMs
alone, at the shapes the step runs, take longer than torch's *whole* step
/ 1.5, the goal cannot be reached by removing the other half. This times,
side by side in one process and alternately, a jitted `lax.dot_general` and
`torch.matmul` (same number of threads) on every GEMM of bench_train_step's
step: per layer the forward and both backward products (input gradient,
weight gradient) of the q/k/v/o projections and the MLP's gate/up/down, the
attention's score and value products with their four backward products, and
once the tied lm head's three. Transposed operands are given as the step
has them (an operand stored [K, M] is contracted on its first axis; torch
gets a transposed view), so each library does what it does with them.
Summed weighted by count: "the step's matmuls alone" per library, next to
both whole steps timed alternately in the same run.

    python -m benchmarks.bench_matmul_ceiling --sizes small,medium --rounds 8

Per GEMM the time is a batch of calls (>= `--batch_ms` ms; each call waited
for, so XLA's per-call dispatch, tens of microseconds, counts against it: an
upper bound on its in-step GEMM time) divided by the calls; min and median
over `--rounds` batches, the two libraries' batches alternating.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_train_step import SIZES, config_of, jax_setup, torch_setup  # noqa: E402
from benchmarks.common import parser, print_table, write_json  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One GEMM of the step: out [b?, m, n] = lhs . rhs contracted over k.

    lhs is stored [m, k] (lhs_t False) or [k, m] (True: contracted on its first
    non-batch axis, as a weight gradient's activations are); rhs [k, n] or
    [n, k] (rhs_t True: a tied head's [V, D], an input gradient's weight).
    batch: leading batch size (attention: rows x heads), 0 for a plain GEMM.
    count: how many times the step runs it.
    """

    name: str
    m: int
    k: int
    n: int
    lhs_t: bool = False
    rhs_t: bool = False
    batch: int = 0
    count: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * max(self.batch, 1) * self.m * self.k * self.n

    def shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        lhs = (self.k, self.m) if self.lhs_t else (self.m, self.k)
        rhs = (self.n, self.k) if self.rhs_t else (self.k, self.n)
        pre = (self.batch,) if self.batch else ()
        return pre + lhs, pre + rhs


def _linear(name: str, tokens: int, d_in: int, d_out: int, count: int) -> list[Gemm]:
    """y [T, out] = x [T, in] @ W [in, out]: forward, dx = dy W^T, dW = x^T dy."""
    return [Gemm(f"{name} fwd", tokens, d_in, d_out, count=count),
            Gemm(f"{name} dx", tokens, d_out, d_in, rhs_t=True, count=count),
            Gemm(f"{name} dW", d_in, tokens, d_out, lhs_t=True, count=count)]


def step_gemms(size: str) -> list[Gemm]:
    """Every GEMM of bench_train_step's step at `size` (dense logits, tied head)."""
    c, (_, rows, seq_len) = config_of(size), SIZES[size]
    T, D, F, V = rows * seq_len, c.hidden_size, c.intermediate_size, c.vocab_size
    H, K, hd, n = c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers
    out = (_linear("q_proj", T, D, H * hd, n) + _linear("k_proj", T, D, K * hd, n)
           + _linear("v_proj", T, D, K * hd, n) + _linear("o_proj", T, H * hd, D, n)
           + _linear("mlp gate", T, D, F, n) + _linear("mlp up", T, D, F, n)
           + _linear("mlp down", T, F, D, n))
    b, L = rows * H, seq_len  # attention per (row, query head), queries L x keys L
    out += [Gemm("attn scores fwd q k^T", L, hd, L, rhs_t=True, batch=b, count=n),
            Gemm("attn values fwd p v", L, L, hd, batch=b, count=n),
            Gemm("attn bwd dp = do v^T", L, hd, L, rhs_t=True, batch=b, count=n),
            Gemm("attn bwd dv = p^T do", L, L, hd, lhs_t=True, batch=b, count=n),
            Gemm("attn bwd dq = ds k", L, L, hd, batch=b, count=n),
            Gemm("attn bwd dk = ds^T q", L, L, hd, lhs_t=True, batch=b, count=n)]
    out += [Gemm("lm head fwd h E^T", T, D, V, rhs_t=True),  # tied: E is [V, D]
            Gemm("lm head dh = dlogits E", T, V, D),
            Gemm("lm head dE = dlogits^T h", V, T, D, lhs_t=True)]
    return out


def _jax_fn(g: Gemm):
    ca = (1 if g.batch else 0) if g.lhs_t else (2 if g.batch else 1)
    cb = (2 if g.batch else 1) if g.rhs_t else (1 if g.batch else 0)
    bd = ((0,), (0,)) if g.batch else ((), ())
    return jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((ca,), (cb,)), bd)))


def _torch_fn(g: Gemm):
    import torch

    def f(a, b):
        return torch.matmul(a.transpose(-1, -2) if g.lhs_t else a,
                            b.transpose(-1, -2) if g.rhs_t else b)
    return f


def _batch_seconds(call, block, calls: int) -> float:
    """Mean seconds per call over `calls` calls, each waited for before the next
    (so XLA's runtime cannot overlap two calls; its dispatch is counted)."""
    t0 = time.perf_counter()
    for _ in range(calls):
        block(call())
    return (time.perf_counter() - t0) / calls


def time_gemm(g: Gemm, rounds: int, batch_ms: float, seed: int = 0,
              dtype: str = "float32") -> dict:
    """Per-call seconds (min, median over `rounds` batches) of XLA and torch, alternating,
    and the largest |difference| of their results (same inputs, in `dtype`:
    "float32" or "bfloat16"; both libraries return the inputs' dtype)."""
    import torch

    rng = np.random.default_rng(seed)
    a_np, b_np = (rng.standard_normal(s, dtype=np.float32) for s in g.shapes())
    ja, jb = (jax.device_put(x).astype(dtype) for x in (a_np, b_np))
    ta, tb = (torch.from_numpy(x).to(getattr(torch, dtype)) for x in (a_np, b_np))
    jf, tf = _jax_fn(g), _torch_fn(g)
    with torch.no_grad():
        jo = np.asarray(jf(ja, jb).astype(np.float32))
        to = tf(ta, tb).float().numpy()
        max_diff = float(np.max(np.abs(jo - to)))
        sides = {"xla": (lambda: jf(ja, jb), jax.block_until_ready),
                 "torch": (lambda: tf(ta, tb), lambda o: None)}
        calls = {}
        for side, (call, block) in sides.items():
            one = _batch_seconds(call, block, 1)  # warm
            calls[side] = max(1, math.ceil(batch_ms / 1e3 / max(one, 1e-6)))
        times = {side: [] for side in sides}
        for _ in range(rounds):
            for side, (call, block) in sides.items():
                times[side].append(_batch_seconds(call, block, calls[side]))
    return {"gemm": g.name, "shape": f"{f'{g.batch}x' if g.batch else ''}{g.m}x{g.k}x{g.n}",
            "count": g.count, "xla_min_ms": min(times["xla"]) * 1e3,
            "xla_median_ms": statistics.median(times["xla"]) * 1e3,
            "torch_min_ms": min(times["torch"]) * 1e3,
            "torch_median_ms": statistics.median(times["torch"]) * 1e3,
            "xla_gflops": g.flops / min(times["xla"]) / 1e9,
            "torch_gflops": g.flops / min(times["torch"]) / 1e9,
            "xla_over_torch": min(times["xla"]) / min(times["torch"]),
            "max_abs_diff": max_diff}


def time_steps(size: str, rounds: int) -> dict:
    """Our jitted step and torch's step at `size`, both built first, timed alternately."""
    c, (_, rows, seq_len) = config_of(size), SIZES[size]
    step, state, batch = jax_setup(c, rows, seq_len)
    torch_one = torch_setup(c, rows, seq_len)
    holder = [state]

    def ours():
        holder[0], m = step(holder[0], batch)
        jax.block_until_ready(m)

    ours()
    torch_one()
    times = {"xla": [], "torch": []}
    for _ in range(rounds):
        for side, fn in (("xla", ours), ("torch", torch_one)):
            t0 = time.perf_counter()
            fn()
            times[side].append(time.perf_counter() - t0)
    return {f"{side}_step_{stat}_s": f(ts) for side, ts in times.items()
            for stat, f in (("min", min), ("median", statistics.median))}


def ceiling(size: str, rounds: int, batch_ms: float, steps: bool = True) -> dict:
    """Every GEMM of the step timed both ways, their count-weighted sums, and (steps)
    both whole steps; `reachable_1p5x`: XLA's matmuls alone fit in torch's step / 1.5."""
    gemms = [dict(time_gemm(g, rounds, batch_ms), flops=g.flops) for g in step_gemms(size)]
    out = {"size": size, "gemms": gemms}
    for side in ("xla", "torch"):
        for stat in ("min", "median"):
            out[f"{side}_matmuls_{stat}_s"] = sum(
                r[f"{side}_{stat}_ms"] * r["count"] for r in gemms) / 1e3
    out["matmul_flops"] = sum(r["flops"] * r["count"] for r in gemms)
    if steps:
        out.update(time_steps(size, rounds))
        out["budget_for_1p5x_s"] = out["torch_step_min_s"] / 1.5
        out["reachable_1p5x"] = out["xla_matmuls_min_s"] <= out["budget_for_1p5x_s"]
        out["xla_matmul_share_of_xla_step"] = out["xla_matmuls_min_s"] / out["xla_step_min_s"]
        out["torch_matmul_share_of_torch_step"] = (out["torch_matmuls_min_s"]
                                                   / out["torch_step_min_s"])
    return out


def main(argv=None):
    import torch

    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default="small,medium")
    p.add_argument("--rounds", type=int, default=8, help="timed batches per GEMM / steps per side")
    p.add_argument("--batch_ms", type=float, default=20.0, help="wall ms per timed batch of calls")
    p.add_argument("--torch_threads", type=int, default=os.cpu_count(),
                   help="torch intra-op threads (XLA:CPU's pool uses every core)")
    p.add_argument("--no_steps", action="store_true", help="GEMMs only, no whole steps")
    args = p.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    results = []
    for size in args.sizes.split(","):
        if size not in SIZES:
            raise SystemExit(f"unknown size {size!r}; choose from {sorted(SIZES)}")
        r = ceiling(size, args.rounds, args.batch_ms, steps=not args.no_steps)
        results.append(r)
        print(f"\n{size}: GEMMs (ms per call, min of {args.rounds}; count = per step)")
        print_table(r["gemms"], ["gemm", "shape", "count", "xla_min_ms", "torch_min_ms",
                                 "xla_over_torch", "xla_gflops", "torch_gflops"])
        line = (f"{size}: the step's matmuls alone: XLA {r['xla_matmuls_min_s'] * 1e3:.1f} ms, "
                f"torch {r['torch_matmuls_min_s'] * 1e3:.1f} ms (min; medians "
                f"{r['xla_matmuls_median_s'] * 1e3:.1f} / {r['torch_matmuls_median_s'] * 1e3:.1f})")
        print(line)
        if not args.no_steps:
            print(f"{size}: whole step: XLA {r['xla_step_min_s'] * 1e3:.1f} ms, torch "
                  f"{r['torch_step_min_s'] * 1e3:.1f} ms (min; medians "
                  f"{r['xla_step_median_s'] * 1e3:.1f} / {r['torch_step_median_s'] * 1e3:.1f}); "
                  f"1.5x torch needs a step <= {r['budget_for_1p5x_s'] * 1e3:.1f} ms: "
                  f"{'reachable' if r['reachable_1p5x'] else 'NOT reachable'} by matmul time "
                  f"alone (matmuls are {r['xla_matmul_share_of_xla_step']:.2f} of our step, "
                  f"{r['torch_matmul_share_of_torch_step']:.2f} of torch's)")
    print(f"torch threads: {torch.get_num_threads()}, load average: {os.getloadavg()}")
    write_json(args.out, {"benchmark": "matmul_ceiling", "torch_threads": torch.get_num_threads(),
                          "rounds": args.rounds, "loadavg": os.getloadavg(), "rows": results})
    return results


if __name__ == "__main__":
    main()
