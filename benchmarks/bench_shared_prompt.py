"""A group's shared prompt in the JaxSampler: prefilled once (share_prefix) or once per
attempt, side by side in one process (issue 66).

    python -m benchmarks shared_prompt --out bench_results/shared_prompt.json

A group of `--attempts` attempts of one `--prompt_len`-token prompt (GRPO's case:
the same prompt, one seed per attempt) arrives at the sampler together, each asks
for exactly `--max_tokens` tokens (no stop token) at temperature 1. Two samplers
serve the same random decoder (`--size`: bench_loop_race's sizes), one with
`share_prefix=True` (the default) and one with False; rounds alternate them, and
every round draws a new prompt, the same for both, so no free row holds it from
an earlier round (as in RL, where the weights change every step and the cache is
cleared). The first round of each is a warm-up (compiles), not reported.

Reported per mode (median over `--rounds`): rollout_s (the group's wall time, submit
to the last result), prefill_s and decode_s (the sampler's own time in those
calls), prefill_tokens (prompt tokens computed), shared_tokens (copied from the
row that computed them). Over all rounds (the warm-up too): the attempts whose
tokens differ between the modes (`diverged` of `compared`) and the largest
log-prob difference before an attempt's first differing token
(`max_logprob_diff`). The copied keys/values equal the computed ones to fp32
rounding (a one-row prefill against an n-row one), and a near-uniform random
model over 2,048 tokens has a boundary of the inverse-CDF draw within that
rounding of u about once in a thousand tokens: now and then an attempt draws the
neighbouring token id and diverges from there.
The JSON carries the machine record and the load average at the start and end.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import numpy as np
from flax import nnx

from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.sampling import JaxSampler, SamplingParams
from benchmarks.common import WIDTHS, parser, print_table, write_json

SIZES = {"toy": WIDTHS["tiny"], "small": WIDTHS["small"], "medium": WIDTHS["medium"]}
COUNTERS = ("prefill_s", "decode_s", "prefill_tokens", "cached_tokens", "shared_tokens")


def _group(sampler: JaxSampler, prompt: list[int], attempts: int, max_tokens: int):
    """One group through `sampler`: (wall seconds, counter deltas, results)."""
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens)

    async def go():
        return await asyncio.gather(*[sampler.generate(prompt, params.replace(seed=i))
                                      for i in range(attempts)])

    before = sampler.counters()
    t0 = time.perf_counter()
    results = asyncio.run(go())
    wall = time.perf_counter() - t0
    after = sampler.counters()
    assert all(len(r.output_ids) == max_tokens for r in results)
    return wall, {k: after[k] - before[k] for k in COUNTERS}, results


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--attempts", default="4,8", help="group sizes, comma-separated")
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--max_tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefill_chunk", type=int, default=512)
    p.add_argument("--steps_per_sync", type=int, default=8)
    args = p.parse_args(argv)
    groups = [int(x) for x in args.attempts.split(",")]
    cfg = DecoderConfig.tiny(vocab_size=args.vocab, tie_embeddings=False,
                             max_position_embeddings=4096, **SIZES[args.size])
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    ctx = args.prompt_len + args.max_tokens
    load = [os.getloadavg()]
    rng = np.random.default_rng(0)
    rows, diverged, compared, worst = [], 0, 0, 0.0
    for n in groups:
        kw = dict(max_context=ctx, max_batch=n, min_batch=n, min_cache_len=ctx,
                  prefill_chunk=args.prefill_chunk, min_prefill_rows=1,
                  steps_per_sync=args.steps_per_sync, max_top_logprobs=0, seed=0)
        samplers = {"shared": JaxSampler(model, share_prefix=True, **kw),
                    "per_attempt": JaxSampler(model, share_prefix=False, **kw)}
        runs: dict[str, list] = {m: [] for m in samplers}
        try:
            for rnd in range(args.rounds + 1):  # round 0: warm-up (compiles)
                prompt = rng.integers(1, args.vocab, args.prompt_len).tolist()
                got = {}
                for mode, s in samplers.items():
                    wall, d, res = _group(s, prompt, n, args.max_tokens)
                    got[mode] = res
                    if rnd:
                        runs[mode].append((wall, d))
                for a, b in zip(got["shared"], got["per_attempt"], strict=True):
                    ids_a, ids_b = np.asarray(a.output_ids), np.asarray(b.output_ids)
                    k = int(np.argmax(ids_a != ids_b)) if (ids_a != ids_b).any() else len(ids_a)
                    diverged += k < len(ids_a)
                    compared += 1
                    if k:  # log-probs up to and including the first differing token
                        d = np.subtract(a.output_logprobs, b.output_logprobs)[: k + 1]
                        worst = max(worst, float(np.max(np.abs(d[:k]), initial=0.0)))
        finally:
            for s in samplers.values():
                s.close()
        for mode, rs in runs.items():
            rows.append({"attempts": n, "mode": mode,
                         "rollout_s": statistics.median(w for w, _ in rs),
                         **{k: statistics.median(d[k] for _, d in rs) for k in COUNTERS}})
    load.append(os.getloadavg())
    print_table(rows, ["attempts", "mode", "rollout_s", "prefill_s", "decode_s",
                       "prefill_tokens", "shared_tokens", "cached_tokens"])
    print(f"diverged={diverged}/{compared} attempts, max_logprob_diff={worst:.2e} (before "
          f"any divergence) loadavg start={load[0]} end={load[1]}")
    write_json(args.out, {"args": vars(args), "rows": rows, "diverged": diverged,
                          "compared": compared, "max_logprob_diff": worst, "loadavg": load})
    return rows


if __name__ == "__main__":
    main()
