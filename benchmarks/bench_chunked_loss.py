"""Dense vs chunked per-token log-probs + gradient: compiled memory and step time.

One row [1, L] of hidden states [1, L, D] and a tied head [V, D] (Qwen3-0.6B:
V=151,936, D=1024), fp32. Each side computes sum(c * log p(targets)) and its
gradient w.r.t. hidden states and head weight (jit): dense through fp32
logits [L, V] (`token_logprobs`), chunked `--chunks` positions at a time
(`chunked_token_logprobs`). Memory is XLA's compiled `memory_analysis()`
(temp = live intermediates; deterministic, no run needed); time is the
median of `--repeats` runs after one warm-up, measured only where args +
temp fit under `--max_gb` (else the row says so and `skipped` counts it;
--max_gb 0 lists memory only).

    python -m benchmarks.bench_chunked_loss --lengths 1024,4096 --out bench_results/chunked_loss.json
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ac2_jax.losses import LMHead, chunked_token_logprobs, token_logprobs  # noqa: E402
from benchmarks.common import parser, print_table, time_fn, write_json  # noqa: E402

GB = 2.0 ** 30


def loss_fns(targets, cot, chunks) -> dict:
    """name -> (hidden [1, L, D], head weight [V, D]) -> scalar loss."""
    def dense(h, w):
        return (cot * token_logprobs(LMHead(w, "vd").logits(h), targets)).sum()

    def chunked(chunk):
        return lambda h, w: (cot * chunked_token_logprobs(h, LMHead(w, "vd"), targets,
                                                          chunk_size=chunk)).sum()

    return {"dense": dense, **{f"chunked({c})": chunked(c) for c in chunks}}


def bench_one(name, fn, h, w, repeats: int, max_gb: float) -> dict:
    step = jax.jit(jax.value_and_grad(fn, (0, 1)))
    t0 = time.perf_counter()
    compiled = step.lower(h, w).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    row = {"impl": name, "temp_GB": mem.temp_size_in_bytes / GB,
           "args_GB": mem.argument_size_in_bytes / GB, "out_GB": mem.output_size_in_bytes / GB,
           "compile_s": compile_s}
    need = (mem.temp_size_in_bytes + mem.argument_size_in_bytes
            + mem.output_size_in_bytes) / GB
    if need > max_gb:
        row["step_s"] = None
        row["note"] = f"not run: needs {need:.3g} GB > --max_gb {max_gb}"
        return row
    t = time_fn(lambda: jax.block_until_ready(compiled(h, w)), repeats=repeats, warmup=1)
    row["step_s"] = t["median_s"]
    loss, _ = compiled(h, w)
    row["loss"] = float(loss)
    return row


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.set_defaults(repeats=2)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--lengths", default="1024,4096")
    p.add_argument("--chunks", default="256,1024", help="positions per chunk, one run each")
    p.add_argument("--max_gb", type=float, default=12.0,
                   help="run (time) a variant only if its compiled args + temp + outputs fit")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(0, 0.02, (args.vocab, args.dim)), jnp.float32)
    rows, skipped = [], 0
    for length in (int(n) for n in args.lengths.split(",")):
        h = jnp.asarray(rng.normal(0, 1, (1, length, args.dim)), jnp.float32)
        targets = jnp.asarray(rng.integers(0, args.vocab, (1, length)), jnp.int32)
        cot = jnp.asarray(rng.normal(size=(1, length)), jnp.float32)
        chunks = [int(c) for c in args.chunks.split(",")]
        for name, fn in loss_fns(targets, cot, chunks).items():
            row = {"L": length, "V": args.vocab, "D": args.dim,
                   "full_logits_GB": length * args.vocab * 4 / GB,
                   **bench_one(name, fn, h, w, args.repeats, args.max_gb)}
            skipped += row["step_s"] is None
            rows.append(row)
    print_table(rows, ["L", "impl", "full_logits_GB", "temp_GB", "args_GB", "compile_s",
                       "step_s", "note"])
    if skipped:
        print(f"{skipped} variant(s) not timed (over --max_gb); their memory is still listed")
    write_json(args.out, {"benchmark": "chunked_loss", "chunks": args.chunks,
                          "repeats": args.repeats, "skipped": skipped, "rows": rows})
    return {"rows": rows, "skipped": skipped}


if __name__ == "__main__":
    main()
