"""Tree vs flat packing: tokens processed and train-step (loss + grads) time.

Scenarios: (a) a GRPO group of 8 attempts sharing a 512-token prompt with
128-token responses; (b) a multi-response fork: 384 tokens of shared history
(with earlier agent turns) and 4 branches of 128 tokens. Same model, same
jitted value_and_grad of the PPO task_mean loss, fp32.

    python -m benchmarks.bench_tree_packing --out bench_results/tree_packing.json
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ac2_jax.losses import aggregate_loss, policy_gradient_loss, token_logprobs
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.segments import pack_segments
from ac2_jax.training.rl import rl_segment
from benchmarks.common import parser, print_table, time_fn, write_json


def group(n=8, prompt=512, resp=128, vocab=1024):
    rng = np.random.default_rng(0)
    p = rng.integers(1, vocab, prompt).tolist()
    return [rl_segment(p + rng.integers(1, vocab, resp).tolist(), [0] * prompt + [1] * resp,
                    [0.0] * prompt + [-1.0] * resp, task=f"g/{i}", advantage=float(i % 2) - 0.5)
            for i in range(n)]


def fork(n=4, hist=384, resp=128, vocab=1024):
    rng = np.random.default_rng(1)
    h = rng.integers(1, vocab, hist).tolist()
    hmask = [0] * (hist // 2) + [1] * (hist // 4) + [0] * (hist - hist // 2 - hist // 4)
    return [rl_segment(h + rng.integers(1, vocab, resp).tolist(), hmask + [1] * resp,
                    [-1.0 * m for m in hmask] + [-1.0] * resp, task="fork/0", advantage=0.5)
            for _ in range(n)]


def main():
    args = parser(__doc__).parse_args()
    cfg = DecoderConfig(vocab_size=1024, hidden_size=256, intermediate_size=768, num_layers=4,
                        num_heads=8, num_kv_heads=4, head_dim=32, dtype=jnp.float32)
    graphdef, params = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)))

    @jax.jit
    def loss_grad(params, b):
        def f(p):
            logits = nnx.merge(graphdef, p)(b.tokens, b.positions, b.segment_ids, b.subtree_end)
            lp = token_logprobs(logits, b.targets)
            per_tok = policy_gradient_loss(lp, jax.lax.stop_gradient(lp), b.features["sampler_logprobs"],
                                           b.features["advantages"], b.loss_mask)
            return aggregate_loss(per_tok, b, "task_mean")
        return jax.value_and_grad(f)(params)

    rows = []
    for name, segs in (("group8_p512_r128", group()), ("fork4_h384_r128", fork())):
        longest = max(len(s) for s in segs)
        flat = pack_segments(segs, seq_len=longest)
        # One row holding the whole trie, padded only to a multiple of 64.
        size = pack_segments(segs, seq_len=sum(len(s) for s in segs), layout="tree").num_real_tokens
        tree = pack_segments(segs, seq_len=-(-size // 64) * 64, layout="tree")
        lf, _ = loss_grad(params, flat)
        lt, _ = loss_grad(params, tree)
        t_f = time_fn(lambda: jax.block_until_ready(loss_grad(params, flat)), args.repeats)
        t_t = time_fn(lambda: jax.block_until_ready(loss_grad(params, tree)), args.repeats)
        rows.append({"scenario": name, "flat_tokens": flat.num_real_tokens,
                     "tree_tokens": tree.num_real_tokens,
                     "token_ratio": flat.num_real_tokens / tree.num_real_tokens,
                     "flat_step_s": t_f["median_s"], "tree_step_s": t_t["median_s"],
                     "speedup": t_f["median_s"] / t_t["median_s"],
                     "loss_rel_diff": abs(float(lt) - float(lf)) / abs(float(lf))})
    print_table(rows, ["scenario", "flat_tokens", "tree_tokens", "token_ratio", "flat_step_s",
                       "tree_step_s", "speedup", "loss_rel_diff"])
    write_json(args.out, {"benchmark": "tree_packing", "rows": rows})


if __name__ == "__main__":
    main()
