"""Merge savings: a k-request append-only episode as ONE forward vs k forwards.

Each request adds `--turn_prompt` new prompt tokens and `--turn_output`
sampled tokens. The per-request view runs every request's full context
(prompt ++ output) again; the merged view runs the last request's tokens
once. Same model, same jitted forward, fp32.

    python -m benchmarks.bench_merge_savings --out bench_results/merge_savings.json
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.segments import pack_segments, segments_from_trace
from ac2_jax.trace import Completion, Trace, TraceRecorder
from benchmarks.common import parser, print_table, time_fn, write_json


def episode_trace(k: int, turn_prompt: int, turn_output: int, vocab: int, seed: int = 0) -> Trace:
    rng = np.random.default_rng(seed)
    trace, ctx = Trace(task_id="bench"), []
    rec = TraceRecorder(trace)
    for _ in range(k):
        ctx = ctx + rng.integers(1, vocab, turn_prompt).tolist()
        out = rng.integers(1, vocab, turn_output).tolist()
        rec.record("main", Completion(ctx, out, [-1.0] * turn_output))
        ctx = ctx + out
    return trace


def main():
    p = parser(__doc__)
    p.add_argument("--turn_prompt", type=int, default=48)
    p.add_argument("--turn_output", type=int, default=16)
    p.add_argument("--ks", default="2,4,8,16")
    args = p.parse_args()
    cfg = DecoderConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_layers=4,
                        num_heads=8, num_kv_heads=4, head_dim=32, dtype=jnp.float32)
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))

    @jax.jit
    def forward(params, b):
        model = nnx.merge(graphdef, params)
        return model(b.tokens, b.positions, b.segment_ids).sum()

    rows = []
    for k in map(int, args.ks.split(",")):
        trace = episode_trace(k, args.turn_prompt, args.turn_output, cfg.vocab_size)
        total = k * (args.turn_prompt + args.turn_output)
        merged = pack_segments(segments_from_trace(trace, "episode"), seq_len=total)
        per_req = pack_segments(segments_from_trace(trace, "request"), seq_len=total)
        t_m = time_fn(lambda: forward(params, merged).block_until_ready(), args.repeats)
        t_r = time_fn(lambda: forward(params, per_req).block_until_ready(), args.repeats)
        rows.append({"k": k, "merged_tokens": merged.num_real_tokens,
                     "per_request_tokens": per_req.num_real_tokens,
                     "token_ratio": per_req.num_real_tokens / merged.num_real_tokens,
                     "merged_s": t_m["median_s"], "per_request_s": t_r["median_s"],
                     "time_ratio": t_r["median_s"] / t_m["median_s"]})
    print_table(rows, ["k", "merged_tokens", "per_request_tokens", "token_ratio", "merged_s",
                       "per_request_s", "time_ratio"])
    write_json(args.out, {"benchmark": "merge_savings", "config": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
