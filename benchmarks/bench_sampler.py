"""Decode speed: JaxSampler vs transformers `generate`, same weights, CPU.

One random-init decoder (sizes below, fp32) is exported with
`save_hf_checkpoint` and loaded with `AutoModelForCausalLM` (torch, CPU), so
both sides run identical weights. Each side generates exactly N new tokens
(no EOS) for a batch of B prompts of `--prompt_len` tokens (torch runs with
the faster of 1 thread and all cores, picked at warm-up); the table gives
wall seconds, new tokens/s (all rows) and ms per decode step, for several N
(time per step vs sequence length). JaxSampler numbers exclude compilation
(one warm-up run per shape; median of --repeats), transformers takes the
median of --hf_repeats after one warm-up call; `jax_decode_ms` is the time inside decode chunks
only (no prefill, no host bookkeeping). `agree` is the number of leading
greedy tokens both sides produce identically for row 0 (fp32 near-ties can
split them later). `--temperature T` (> 0) times sampled decoding instead,
the RL collector's case: both sides draw from softmax(logits / T) with no
top-k / top-p (transformers: do_sample=True, top_k=0, top_p=1), seeded;
`agree` is then not computed (the two RNGs differ).

    python -m benchmarks.bench_sampler --out bench_results/sampler.json
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time

import numpy as np
from flax import nnx

from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.models.io.hf_io import save_hf_checkpoint
from ac2_jax.sampling import JaxSampler, SamplingParams
from benchmarks.common import parser, print_table, write_json


def _prompts(batch: int, prompt_len: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return rng.integers(1, vocab, size=(batch, prompt_len)).tolist()


def _jax_run(sampler: JaxSampler, prompts, n: int, temperature: float = 0.0):
    params = SamplingParams(temperature=temperature, max_tokens=n)

    async def go():
        return await asyncio.gather(*[sampler.generate(p, params.replace(seed=i) if temperature
                                                       else params)
                                      for i, p in enumerate(prompts)])

    d0 = sampler.stats.decode_s
    t0 = time.perf_counter()
    results = asyncio.run(go())
    wall = time.perf_counter() - t0
    assert all(len(r.output_ids) == n for r in results)
    return wall, sampler.stats.decode_s - d0, results[0].output_ids


def _hf_run(hf, prompts, n: int, temperature: float = 0.0):
    import torch
    ids = torch.tensor(prompts, dtype=torch.long)
    sample = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature \
        else dict(do_sample=False)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, eos_token_id=None, pad_token_id=0, **sample)
    wall = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + n
    return wall, out[0, ids.shape[1]:].tolist()


def main(argv=None):
    p = parser(__doc__)
    p.set_defaults(repeats=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv_heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--lengths", default="32,128,256")
    p.add_argument("--hf_repeats", type=int, default=1)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--steps_per_sync", type=int, default=16)
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (default); > 0: sampled decoding on both sides")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]

    cfg = DecoderConfig.tiny(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, tie_embeddings=False,
        max_position_embeddings=4096)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    n_params = sum(x.size for x in __import__("jax").tree.leaves(nnx.state(model)))
    sampler = JaxSampler(model, max_context=args.prompt_len + max(lengths) + 1,
                         max_batch=max(batches), steps_per_sync=args.steps_per_sync,
                         min_cache_len=128, max_top_logprobs=0)
    hf, torch_threads = None, None
    if not args.skip_hf:
        import torch
        from transformers import AutoModelForCausalLM
        tmp = tempfile.mkdtemp(prefix="bench_sampler_")
        save_hf_checkpoint(model, tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        # Torch's best thread count on a shared CPU (OpenMP spinning can make
        # more threads slower): warm up, then keep the faster of 1 and all.
        warm = _prompts(max(batches), args.prompt_len, args.vocab)
        speed = {}
        for n in sorted({1, os.cpu_count() or 1}):
            torch.set_num_threads(n)
            _hf_run(hf, warm, 4)
            speed[n] = _hf_run(hf, warm, 16)[0]
        torch_threads = min(speed, key=speed.get)
        torch.set_num_threads(torch_threads)

    rows = []
    for b in batches:
        prompts = _prompts(b, args.prompt_len, args.vocab)
        for n in lengths:
            t0 = time.perf_counter()
            T = args.temperature
            _jax_run(sampler, prompts, n, T)  # compiles the shapes this run needs
            compile_s = time.perf_counter() - t0
            runs = [_jax_run(sampler, prompts, n, T) for _ in range(args.repeats)]
            wall = statistics.median(r[0] for r in runs)
            dec = statistics.median(r[1] for r in runs)
            row = {"batch": b, "new_tokens": n, "jax_s": wall, "jax_tok_s": b * n / wall,
                   "jax_ms_step": 1000 * wall / n, "jax_decode_ms": 1000 * dec / n,
                   "jax_first_run_s": compile_s}
            if hf is not None:
                hf_runs = [_hf_run(hf, prompts, n, T) for _ in range(args.hf_repeats)]
                hw = statistics.median(r[0] for r in hf_runs)
                a, h = runs[0][2], hf_runs[0][1]
                agree = None if T else next(
                    (i for i, (x, y) in enumerate(zip(a, h)) if x != y), len(a))
                row.update({"hf_s": hw, "hf_tok_s": b * n / hw, "hf_ms_step": 1000 * hw / n,
                            "speedup": hw / wall, "agree": agree})
            rows.append(row)
            print(row, flush=True)
    sampler.close()
    print(f"\nmodel: {n_params / 1e6:.2f}M params (hidden {args.hidden}, {args.layers} layers, "
          f"vocab {args.vocab}), fp32, prompt {args.prompt_len} tokens, "
          f"{f'temperature {args.temperature:g}' if args.temperature else 'greedy'}, "
          f"cpus {os.cpu_count()}, torch threads {torch_threads}")
    cols = ["batch", "new_tokens", "jax_s", "jax_tok_s", "jax_ms_step", "jax_decode_ms",
            "hf_s", "hf_tok_s", "hf_ms_step", "speedup", "agree", "jax_first_run_s"]
    print_table(rows, cols)
    write_json(args.out, {"benchmark": "sampler", "config": vars(args),
                          "params": int(n_params), "torch_threads": torch_threads,
                          "rows": rows})
    return rows


if __name__ == "__main__":
    main()
