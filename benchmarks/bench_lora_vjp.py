"""Same-process A/B of a LoRA train step: `lora.lora_update`'s hand-written backward
vs the autodiff form of the same product, beside a full fine-tuning step.

Each variant (rank-16 adapters on all seven projections, scanned layers, remat "full",
PolicyGradientLoss chunked 256; the full variant has no adapters) is compiled first,
then all are timed alternately, `--rounds` steps each; reported: min and median
seconds and the first-step loss.

    python -m benchmarks.bench_lora_vjp --hidden 1024 --ffn 3072 --layers 4 --tokens 1024 --rounds 5
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ac2_jax.models import Decoder, DecoderConfig  # noqa: E402
from ac2_jax.models import lora as lora_mod  # noqa: E402
from ac2_jax.models.lora import LoRAConfig  # noqa: E402
from ac2_jax.segments import pack_segments  # noqa: E402
from ac2_jax.training import (OptimizerConfig, PolicyGradientLoss,  # noqa: E402
                              create_train_state, make_train_step)
from ac2_jax.training.rl import rl_segment  # noqa: E402
from benchmarks.common import parser, print_table, write_json  # noqa: E402

VARIANTS = ("custom", "autodiff", "full")


def autodiff_update(x, a, b, scale):
    """`lora_update`'s forward, differentiated by JAX."""
    return jnp.einsum("...r,ro->...o", jnp.einsum("...i,ir->...r", x, a), b) * jnp.asarray(
        scale, x.dtype)


def build(variant: str, args):
    """(step, placed state, batch, first loss) of one variant; the product is swapped
    only while the step is traced (its first call)."""
    custom = lora_mod.lora_update
    lora_mod.lora_update = autodiff_update if variant == "autodiff" else custom
    try:
        c = DecoderConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                          intermediate_size=args.ffn, num_layers=args.layers,
                          num_heads=args.hidden // 64, num_kv_heads=max(args.hidden // 128, 1),
                          head_dim=64, tie_embeddings=True, qk_norm=True, scan_layers=True,
                          remat="full",
                          lora=None if variant == "full" else LoRAConfig(rank=16, alpha=32))
        n = args.tokens
        ids = np.random.default_rng(0).integers(0, args.vocab, n)
        seg = rl_segment(ids, np.r_[np.zeros(n // 2), np.ones(n - n // 2)], np.full(n, -1.0),
                         task="t0", advantage=1.0)
        batch = pack_segments([seg], n)
        opt = OptimizerConfig(learning_rate=1e-6)
        graphdef, state = create_train_state(Decoder(c, rngs=nnx.Rngs(0)), opt)
        step = make_train_step(graphdef, PolicyGradientLoss(mode="task_mean", chunk_size=256),
                               opt)
        state, m = step(step.place(state), batch)
        jax.block_until_ready(m)
    finally:
        lora_mod.lora_update = custom
    return step, state, batch, float(m["loss"])


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=3072)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    runs = {v: build(v, args) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for v, (step, state, batch, loss) in runs.items():
            t0 = time.perf_counter()
            state, m = step(state, batch)
            jax.block_until_ready(m)
            times[v].append(time.perf_counter() - t0)
            runs[v] = (step, state, batch, loss)
    rows = [{"variant": v, "min_s": min(t), "median_s": statistics.median(t),
             "first_loss": runs[v][3]} for v, t in times.items()]
    print_table(rows, ["variant", "min_s", "median_s", "first_loss"])
    write_json(args.out, {"benchmark": "lora_vjp", "args": vars(args), "rows": rows,
                          "loadavg": os.getloadavg()})
    return rows


if __name__ == "__main__":
    main()
