"""Where one RL step from long agent rows goes: host packing, the train step's compile
and run, and the reference forward passes of a log-prob check, in process CPU seconds
(and wall; on a shared machine only the CPU seconds compare).

The shapes of tests/orchestration/test_cli_presets.py's default-settings CLI step:
the tiny Decoder of that test (hidden 32, 2 layers, 2 heads over 1 kv head, vocab
512, untied head), `attempts` traces of one completion each (a `--prompt`-token
prompt, `--output` sampled tokens, rewards alternating 0 / 1), one PPO update
(`RLTrainer.update`, `BatchConfig(rows=--rows, seq_len=--seq_len)`), then one fp32
forward pass per completion padded to a 1,024 bucket (what the test's log-prob check
runs). XLA's flags come from the environment, so the same command compares the test
suite's -O0 / no-fusion-emitters setting (tests/conftest.py) with XLA's defaults:

    python -m benchmarks.bench_long_rows --prompt 32000
    XLA_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false" \\
        python -m benchmarks.bench_long_rows --prompt 32000

`--kernel` times only the attention kernel the model picks for such rows ("auto" on
CPU: block-sparse, 128-token tiles) on one causal row of `--prompt` tokens, forward
and forward + backward, in CPU seconds per call and per causal (query, key) pair and
head, under the same two flag settings:

    python -m benchmarks.bench_long_rows --kernel --prompt 4096

Every phase is timed twice where a second call is the steady state (the update and the
first forward: first = compile + run). The figures are in
docs/notes/2026-12-07-default-settings-cli-rl-steps.md.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import cpu_record, parser, print_table, write_json  # noqa: E402


def cpu_s() -> float:
    """CPU seconds of this process, all threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Clock:
    def __init__(self):
        self.rows: list[dict] = []

    def time(self, name, fn):
        w, c = time.perf_counter(), cpu_s()
        out = fn()
        jax.block_until_ready(out)
        self.rows.append({"phase": name, "wall_s": round(time.perf_counter() - w, 2),
                          "cpu_s": round(cpu_s() - c, 2)})
        print(self.rows[-1], flush=True)
        return out


def long_traces(attempts: int, prompt: int, output: int, vocab: int, seed: int = 0):
    """`attempts` finished traces of one task, one completion each."""
    from ac2_jax.trace.types import Completion, Episode, Trace

    rng = np.random.default_rng(seed)
    traces = []
    for i in range(attempts):
        p = rng.integers(3, vocab, prompt).tolist()
        o = rng.integers(3, vocab, output).tolist()
        lp = (-rng.random(output) * 3).tolist()
        c = Completion(prompt_ids=p, output_ids=o, output_logprobs=lp)
        ep = Episode(agent="main", token_ids=p + o, loss_mask=[0] * prompt + [1] * output,
                     sampler_logprobs=[0.0] * prompt + lp, completions=[c])
        traces.append(Trace(task_id="t", group_id="g", episodes=[ep], reward=float(i % 2),
                            status="finished"))
    return traces


def kernel(tokens: int, block: int = 128) -> list[dict]:
    """Block-sparse attention of the test's head shape (2 query heads over 1 kv head,
    head_dim 16) on one causal row: CPU seconds per call, forward and forward +
    backward (the second and third calls, after the compile)."""
    import jax.numpy as jnp

    from ac2_jax.models.kernels.attention import attention
    from ac2_jax.models.kernels.attention_mask import AttentionMask

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, tokens, 2, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, tokens, 1, 16)), jnp.float32) for _ in range(2))
    seg = jnp.ones((1, tokens), jnp.int32)

    def f(q, k, v, seg):
        return attention(q, k, v, AttentionMask.packed(seg), backend="blocksparse",
                         block=block).sum()

    rows = []
    for name, fn in (("forward", f), ("forward + backward",
                                      jax.value_and_grad(f, argnums=(0, 1, 2)))):
        call = jax.jit(fn).lower(q, k, v, seg).compile()
        jax.block_until_ready(call(q, k, v, seg))
        c = cpu_s()
        for _ in range(2):
            jax.block_until_ready(call(q, k, v, seg))
        per_call = (cpu_s() - c) / 2
        pairs = tokens * (tokens + 1) / 2 * 2  # causal pairs x query heads
        rows.append({"phase": f"block-sparse {name}, {tokens} tokens", "cpu_s": round(per_call, 3),
                     "ns_per_pair_head": round(per_call / pairs * 1e9, 1)})
        print(rows[-1], flush=True)
    return rows


def main():
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=32000, help="prompt tokens per completion")
    p.add_argument("--output", type=int, default=8, help="sampled tokens per completion")
    p.add_argument("--attempts", type=int, default=4)
    p.add_argument("--rows", type=int, default=1, help="BatchConfig.rows (the test had 8)")
    p.add_argument("--seq_len", type=int, default=65536)
    p.add_argument("--reference", type=int, default=-1,
                   help="reference forward passes to time (-1: one per completion)")
    p.add_argument("--kernel", action="store_true", help="time only the attention kernel")
    args = p.parse_args()
    if args.kernel:
        rows = kernel(args.prompt)
        print_table(rows, ["phase", "cpu_s", "ns_per_pair_head"])
        print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
        if args.out:
            write_json(args.out, {"args": vars(args), "rows": rows, "machine": cpu_record()})
        return

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.training import RLConfig
    from ac2_jax.training.rl import BatchConfig, RLTrainer
    from ac2_jax.training.rl.batching import batch_segments, pack_rl_batch

    context = max(args.seq_len, args.prompt + args.output)
    cfg = DecoderConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=2, num_kv_heads=1, head_dim=16,
                        max_position_embeddings=context, tie_embeddings=False)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    traces = long_traces(args.attempts, args.prompt, args.output, cfg.vocab_size)
    config = RLConfig(steps=1, tasks_per_step=1, attempts_per_task=args.attempts,
                      concurrency=args.attempts,
                      batch=BatchConfig(rows=args.rows, seq_len=args.seq_len))
    clock = Clock()
    with tempfile.TemporaryDirectory() as workdir:
        trainer = RLTrainer(Decoder(cfg, rngs=nnx.Rngs(0)), None, config, workdir)

        def pack():
            segs, stats, _ = batch_segments(traces, 0, trainer._batch_config)
            return pack_rl_batch(segs, stats.row_len, trainer._batch_config).tokens

        shape = clock.time("host: select, segment, pack", pack).shape
        for name in ("update 1 (compile + run)", "update 2 (run)"):
            clock.time(name, lambda: trainer.update(traces) and trainer.state)
        trainer.close()

    logits = nnx.jit(lambda m, t, p, s: m(t, p, s).astype("float32"))
    n = args.prompt + args.output
    L = -(-n // 1024) * 1024
    refs = args.attempts if args.reference < 0 else args.reference
    pos = np.arange(L, dtype=np.int32)[None]
    for i in range(refs):
        toks = np.zeros((1, L), np.int32)
        toks[0, :n] = traces[i].episodes[0].token_ids
        segs = np.zeros((1, L), np.int32)
        segs[0, :n] = 1
        label = "reference forward 1 (compile + run)" if i == 0 else f"reference forward {i + 1}"
        clock.time(label, lambda t=toks, s=segs: logits(model, t, pos, s))
    total = {k: round(sum(r[k] for r in clock.rows), 2) for k in ("wall_s", "cpu_s")}
    clock.rows.append({"phase": "total", **total})
    print_table(clock.rows, ["phase", "wall_s", "cpu_s"])
    print(f"batch {shape}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    if args.out:
        write_json(args.out, {"args": vars(args), "batch": list(shape), "rows": clock.rows,
                              "machine": cpu_record()})


if __name__ == "__main__":
    main()
