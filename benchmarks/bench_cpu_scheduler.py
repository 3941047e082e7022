"""XLA:CPU's memory-optimized scheduler vs its default, on the train step of
bench_train_step's sizes: step time, alternating the two compiled steps in one
process (so load hits both alike).

The train step compiles with the memory-optimized scheduler on CPU by default
(`make_train_step(cpu_memory_scheduler=True)`, issue 15: it keeps one set of
gradients alive instead of two, 13.3 -> 10.7 GB at the Qwen3-0.6B shape).
This says what it costs in time at the small sizes issue 16 measures.

    python -m benchmarks.bench_cpu_scheduler --sizes small,medium --rounds 4
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from ac2_jax.models import Decoder
from ac2_jax.segments import pack_segments
from ac2_jax.training.rl import rl_segment
from ac2_jax.training import OptimizerConfig, SFTLoss, create_train_state, make_train_step
from benchmarks.common import write_json
from benchmarks.bench_train_step import CLIP, LR, SIZES, WD, config_of, tokens


def compare(name: str, rounds: int) -> dict:
    """Min step seconds of each scheduler over `rounds` alternating steps, and their ratio."""
    c, (_, rows, seq_len) = config_of(name), SIZES[name]
    segs = [rl_segment(r, np.ones(seq_len), np.zeros(seq_len), task=f"t{i}")
            for i, r in enumerate(tokens(c, rows, seq_len))]
    batch = pack_segments(segs, seq_len)
    opt = OptimizerConfig(learning_rate=LR, weight_decay=WD, clip_norm=CLIP, b2=0.999)
    graphdef, state = create_train_state(Decoder(c, rngs=nnx.Rngs(0)), opt)
    loss = SFTLoss(mode="token_mean", entropy=False)
    steps = {on: make_train_step(graphdef, loss, opt, donate=False, cpu_memory_scheduler=on)
             for on in (True, False)}
    placed = {on: steps[on].place(state) for on in steps}
    losses = {}
    for on in steps:  # compile both first
        losses[on] = float(jax.block_until_ready(steps[on](placed[on], batch)[1])["loss"])
    times = {True: [], False: []}
    for _ in range(rounds):
        for on in (True, False):
            t0 = time.perf_counter()
            jax.block_until_ready(steps[on](placed[on], batch)[1])
            times[on].append(time.perf_counter() - t0)
    mem, default = min(times[True]), min(times[False])
    return {"size": name, "memory_optimized_s": mem, "default_s": default,
            "ratio": mem / default, "loss_memory_optimized": losses[True],
            "loss_default": losses[False]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="small,medium")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = [compare(name, args.rounds) for name in args.sizes.split(",")]
    for r in rows:
        print(f"{r['size']}: memory-optimized {r['memory_optimized_s']:.3f} s, default "
              f"{r['default_s']:.3f} s, ratio {r['ratio']:.2f}", flush=True)
    write_json(args.out, {"rows": rows})
    return rows


if __name__ == "__main__":
    main()
