"""What compiling the RL train step ahead (`Trainer.warmup`) saves its first update.

    python -m benchmarks.bench_compile_ahead --rounds 2

The demo's policy (experiments/configs/calculator.py) and its RL batch geometry
(16 tree rows of 512 tokens, 2 micro-batches, capacities 64), 64 segments of 120
tokens. Each round runs, in fresh processes (nothing cached), a cold first update
and a warmup followed by the first update; reported: the seconds of each part.
`--size toy` is a seconds-long version (tests).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from benchmarks.common import parser, print_table, write_json

SIZES = {  # model overrides, rows, seq_len, segments, segment length
    "demo": (dict(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4,
                  num_kv_heads=4, head_dim=16), 16, 512, 64, 120),
    "toy": (dict(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                 num_kv_heads=2, head_dim=8), 4, 64, 8, 20),
}


def one(size: str, warm: bool) -> dict:
    """In this process: (warmup s,) first update s, second update s."""
    import numpy as np
    from flax import nnx

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.training.rl import rl_segment
    from ac2_jax.training import (OptimizerConfig, PolicyGradientLoss, Trainer,
                                  create_train_state)
    from ac2_jax.training.rl.batching import pack_rl_batch, warmup_batch
    from ac2_jax.training.rl.data import BatchConfig

    model, rows, seq_len, n, length = SIZES[size]
    cfg = DecoderConfig(vocab_size=640, max_position_embeddings=seq_len, tie_embeddings=True,
                        **model)
    opt = OptimizerConfig(learning_rate=1e-4)
    graphdef, state = create_train_state(Decoder(cfg, rngs=nnx.Rngs(0)), opt)
    trainer = Trainer(graphdef, state, PolicyGradientLoss(clip_eps=0.2, tis_cap=2.0), opt,
                      grad_accum=2)
    bc = BatchConfig(seq_len=seq_len, rows=rows, layout="tree", task_capacity=n,
                     segment_capacity=n)
    rng = np.random.default_rng(0)
    mask = (np.arange(length) >= length // 2).astype(np.float32)
    real = pack_rl_batch([rl_segment(rng.integers(0, 640, length), mask, np.full(length, -1.0),
                                  task=f"t{i}", advantage=float(rng.normal()))
                          for i in range(n)], seq_len, bc)
    out = {"warmup_s": 0.0}
    if warm:  # as RLTrainer.warmup_step does
        t0 = time.perf_counter()
        trainer.warmup(warmup_batch(bc))
        out["warmup_s"] = time.perf_counter() - t0
    for name in ("first_update_s", "second_update_s"):
        t0 = time.perf_counter()
        trainer.update(real)
        out[name] = time.perf_counter() - t0
    out["compiled_steps"] = trainer.compiled_steps
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--size", default="demo", choices=sorted(SIZES))
    p.add_argument("--_one", default=None, help=argparse.SUPPRESS)  # one run, in this process
    args = p.parse_args()
    if args._one is not None:
        print(json.dumps(one(args.size, args._one == "warm")))
        return
    rows = []
    for r in range(args.rounds):
        for mode in ("cold", "warm"):
            got = subprocess.run([sys.executable, "-m", "benchmarks.bench_compile_ahead",
                                  "--size", args.size, "--_one", mode],
                                 check=True, capture_output=True, text=True)
            rows.append({"round": r + 1, "mode": mode,
                         **json.loads(got.stdout.strip().splitlines()[-1])})
    print_table(rows, ["round", "mode", "warmup_s", "first_update_s", "second_update_s",
                       "compiled_steps"])
    write_json(args.out, {"rows": rows})


if __name__ == "__main__":
    main()
