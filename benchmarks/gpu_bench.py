"""GPU benchmark: bf16 train-step MFU of a ~0.5B Qwen3-shaped decoder, and
JaxSampler greedy decode tokens/s at batch 1 and 64 (one accelerator).

`--preset 0.6b_gpu` (or 1.7b_gpu; experiments/real_size/qwen3.py) runs the
real-size presets instead: their shape, bf16 compute with fp32 master
weights, scanned layers, remat and attention backend ("auto": cuDNN on GPU),
chunked log-probs (`--chunk`), the train plan's rows x seq_len; the train
section also reports the attention backend in use and the compiled step's
temp memory with dense vs chunked log-probs.

Train step: `make_train_step` + `PolicyGradientLoss()` (the RL defaults:
PPO clip, TIS, entropy metric; task_mean) + AdamW, compute in bf16 with fp32
master weights (`dtype=bfloat16, param_dtype=float32`), per-layer remat, on
`--rows` packed rows of `--seq_len` tokens (each row holds `--per_row`
segments; positions restart per segment; half of each segment is agent
tokens). Model FLOPs per step = 6 * matmul params * tokens + 12 * layers *
heads * head_dim * seq_len * tokens (attention over the full row, as the
kernel computes it; remat's recompute not counted). MFU = model FLOP/s / the
assumed peak (`--peak_tflops`, default 989: H200 SXM dense bf16); a measured
bf16 matmul rate is printed next to it. Decode: the same shapes with bf16
weights and KV cache, `--prompt_len` prompt tokens, exactly `--new_tokens`
greedy tokens per row (no stop tokens), one sampler per batch size (fixed row
count and cache length: one compile each); wall time of `generate` calls
after a warm-up run, and the decode-chunk time alone.

Offline: needs only jax (with CUDA), flax, optax, orbax and ac2_jax's light
deps on the path (scripts/gpu_bench.sh sets PYTHONPATH=., installs nothing).
Results are written after every section, so a run cut short keeps them.

    python -m benchmarks.gpu_bench --out bench_results/gpu_bench.json
    python -m benchmarks.gpu_bench --smoke      # tiny shapes, any backend (CPU test)
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import sys
import time

H200_BF16_PEAK_TFLOPS = 989.0  # H200 SXM dense bf16 (no sparsity), NVIDIA spec

FULL = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=24,
            num_heads=16, num_kv_heads=8, head_dim=64)
SMOKE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
             num_heads=4, num_kv_heads=2, head_dim=16)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="write results as JSON here")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes; runs on CPU (defaults JAX_PLATFORMS to cpu)")
    p.add_argument("--peak_tflops", type=float, default=H200_BF16_PEAK_TFLOPS)
    p.add_argument("--vocab", type=int, default=None, help="override the vocabulary size")
    p.add_argument("--rows", type=int, default=None, help="default 8 (smoke: 2)")
    p.add_argument("--seq_len", type=int, default=None, help="default 2048 (smoke: 128)")
    p.add_argument("--per_row", type=int, default=4, help="segments packed into each row")
    p.add_argument("--steps", type=int, default=None,
                   help="timed train steps; default 10 (smoke 2)")
    p.add_argument("--no_remat", action="store_true")
    p.add_argument("--prompt_len", type=int, default=None, help="default 128 (smoke: 16)")
    p.add_argument("--new_tokens", type=int, default=None, help="default 128 (smoke: 16)")
    p.add_argument("--decode_batches", default=None, help="default 1,64 (smoke: 1,4)")
    p.add_argument("--steps_per_sync", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed decode runs per batch size")
    p.add_argument("--matmul_n", type=int, default=None, help="default 8192 (smoke: 256)")
    p.add_argument("--skip", default="", help="comma list of sections to skip: "
                   "matmul,train,decode")
    p.add_argument("--preset", default=None,
                   help="a variant of experiments/real_size/qwen3.py (e.g. 0.6b_gpu, 1.7b_gpu, "
                        "tiny): its shape, dtypes, scan/remat/attention choices and train plan "
                        "(rows x seq_len) replace the defaults; random weights, no checkpoint")
    p.add_argument("--chunk", type=int, default=None,
                   help="log-probs chunk_size in the train step (default: 1024 with --preset, "
                        "else dense); the step's compiled temp memory is reported dense vs chunked")
    a = p.parse_args(argv)
    if a.preset:  # the preset's train plan (rows x seq_len) unless given
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        _, plan = preset_config(a)
        if plan is not None:
            a.rows = a.rows or plan["rows"]
            a.seq_len = a.seq_len or plan["seq_len"]
        if a.chunk is None:
            a.chunk = 1024
    small = a.smoke
    for name, full, smoke in (("rows", 8, 2), ("seq_len", 2048, 128), ("steps", 10, 2),
                              ("prompt_len", 128, 16), ("new_tokens", 128, 16),
                              ("decode_batches", "1,64", "1,4"), ("matmul_n", 8192, 256)):
        if getattr(a, name) is None:
            setattr(a, name, smoke if small else full)
    a.decode_batches = [int(b) for b in str(a.decode_batches).split(",")]
    a.skip = {s for s in a.skip.split(",") if s}
    bad = a.skip - {"matmul", "train", "decode"}
    if bad:
        p.error(f"--skip: unknown sections {sorted(bad)}")
    if a.seq_len % a.per_row:
        p.error(f"--seq_len ({a.seq_len}) must be a multiple of --per_row ({a.per_row})")
    return a


def preset_config(a):
    """(DecoderConfig, train plan) of `--preset` (experiments/real_size/qwen3.py)."""
    import jax.numpy as jnp

    from ac2_jax.models import DecoderConfig
    from experiments.real_size import qwen3
    cfg = qwen3.get_config(a.preset)
    hf = dict(cfg.shape.to_dict(), model_type="qwen3")
    hf["rope_theta"] = hf.get("rope_parameters", {}).get("rope_theta", 1_000_000.0)
    model = cfg.model.to_dict()
    runtime = {k: v for k, v in model.items() if k not in ("dtype", "param_dtype")}
    dc = DecoderConfig.from_hf_config(hf, dtype=jnp.dtype(model.get("dtype", "float32")),
                                      param_dtype=jnp.dtype(model.get("param_dtype", "float32")),
                                      **runtime)
    return dc, (cfg.train.to_dict() if "train" in cfg else None)


def preset_shape(dc) -> dict:
    return dict(vocab_size=dc.vocab_size, hidden_size=dc.hidden_size,
                intermediate_size=dc.intermediate_size, num_layers=dc.num_layers,
                num_heads=dc.num_heads, num_kv_heads=dc.num_kv_heads, head_dim=dc.head_dim)


def shape(a) -> dict:
    if a.preset:
        return preset_shape(preset_config(a)[0])
    s = dict(SMOKE if a.smoke else FULL)
    if a.vocab:
        s["vocab_size"] = a.vocab
    return s


def matmul_params(s: dict) -> int:
    """Weights in a matmul per token: q,k,v,o + SwiGLU per layer, and the lm head."""
    attn = s["hidden_size"] * s["head_dim"] * (2 * s["num_heads"] + 2 * s["num_kv_heads"])
    mlp = 3 * s["hidden_size"] * s["intermediate_size"]
    return s["num_layers"] * (attn + mlp) + s["vocab_size"] * s["hidden_size"]


def step_flops(s: dict, rows: int, seq_len: int) -> tuple[float, float]:
    """(6N * tokens, attention FLOPs) of one forward + backward."""
    tokens = rows * seq_len
    attn = 12.0 * s["num_layers"] * s["num_heads"] * s["head_dim"] * seq_len * tokens
    return 6.0 * matmul_params(s) * tokens, attn


def bench_matmul(n: int) -> dict:
    import jax
    import jax.numpy as jnp
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(ka, (n, n), jnp.bfloat16)
    y = jax.random.normal(kb, (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    f(x, y).block_until_ready()
    iters, t0 = 0, time.perf_counter()
    while iters < 5 or time.perf_counter() - t0 < 1.0:
        out = f(x, y)
        iters += 1
    out.block_until_ready()
    dt = (time.perf_counter() - t0) / iters
    return {"n": n, "ms": 1e3 * dt, "tflops": 2.0 * n ** 3 / dt / 1e12}


def packed_batch(vocab: int, rows: int, seq_len: int, per_row: int):
    import numpy as np

    from ac2_jax.segments import pack_segments
    from ac2_jax.training.rl import rl_segment
    rng = np.random.default_rng(0)
    n = seq_len // per_row
    half = n // 2
    segs = []
    for i in range(rows * per_row):
        mask = np.r_[np.zeros(half), np.ones(n - half)]
        lp = np.where(mask > 0, -rng.uniform(0.5, 3.0, n), 0.0)
        segs.append(rl_segment(rng.integers(0, vocab, n), mask, lp, task=f"t{i // 2}",
                            advantage=0.5 if i % 4 < 2 else -0.5))
    batch = pack_segments(segs, seq_len)
    assert batch.tokens.shape == (rows, seq_len), batch.tokens.shape
    return batch


def bench_train(a, s: dict) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.training import (
        OptimizerConfig,
        PolicyGradientLoss,
        create_train_state,
        make_train_step,
    )
    from ac2_jax.training.core import num_params
    if a.preset:
        cfg = preset_config(a)[0]
        if a.no_remat:
            cfg = cfg.replace(remat="none")
    else:
        cfg = DecoderConfig(**s, tie_embeddings=True, qk_norm=True, rope_theta=1_000_000.0,
                            max_position_embeddings=max(4096, a.seq_len), dtype=jnp.bfloat16,
                            param_dtype=jnp.float32, remat=not a.no_remat)
    batch = packed_batch(cfg.vocab_size, a.rows, a.seq_len, a.per_row)
    opt = OptimizerConfig(learning_rate=1e-5, weight_decay=0.1)
    t0 = time.perf_counter()
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    cfg = model.config  # resolved: the memory plan's scan_layers / remat, reported below
    graphdef, state = create_train_state(model, opt)
    step = make_train_step(graphdef, PolicyGradientLoss(chunk_size=a.chunk), opt)
    state = step.place(state)
    memory = {}
    for name, chunk in (("dense", None), ("chunked", a.chunk or 1024)):
        try:  # the compiled step's temp memory: what the chunked log-probs save
            f = make_train_step(graphdef, PolicyGradientLoss(chunk_size=chunk), opt)
            f._build(state)
            ma = f._step.lower(state, batch, None, None).compile().memory_analysis()
            memory[f"{name}_temp_GB"] = ma.temp_size_in_bytes / 1e9
        except Exception as e:  # noqa: BLE001 - reported, the timed step still runs
            memory[f"{name}_temp_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    from ac2_jax.models.kernels.attention import choose_backend
    backend = choose_backend(cfg.attention_backend, kind="flat", q_len=a.seq_len,
                             dtype=cfg.dtype, head_dim=cfg.head_dim, block=cfg.attention_block)
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    loss = float(m["loss"])
    dense, attn = step_flops(s, a.rows, a.seq_len)
    sec = statistics.median(times)
    out = {"params_M": num_params(state.params) / 1e6, "rows": a.rows, "seq_len": a.seq_len,
           "tokens": a.rows * a.seq_len, "remat": str(cfg.remat), "init_s": init_s,
           "scan_layers": bool(cfg.scan_layers), "attention_backend": backend,
           "chunk_size": a.chunk, "dtype": str(jnp.dtype(cfg.dtype)), **memory,
           "first_step_s": first_s, "step_s": sec, "step_min_s": min(times),
           "tokens_per_s": a.rows * a.seq_len / sec, "model_tflops_per_step": (dense + attn) / 1e12,
           "achieved_tflops": (dense + attn) / sec / 1e12,
           "mfu": (dense + attn) / sec / 1e12 / a.peak_tflops,
           "mfu_6n_only": dense / sec / 1e12 / a.peak_tflops, "loss": loss,
           "loss_finite": math.isfinite(loss)}
    out.update(_memory())
    del state
    return out


def _memory() -> dict:
    import jax
    try:
        stats = jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - not every backend reports memory
        stats = {}
    peak = stats.get("peak_bytes_in_use")
    return {} if peak is None else {"peak_mem_GB": peak / 1e9}


def bench_decode(a, s: dict) -> list[dict]:
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.sampling import SamplingParams
    from ac2_jax.sampling.engine.jax_sampler import JaxSampler
    ctx = a.prompt_len + a.new_tokens
    if a.preset:  # bf16 weights for serving; per-layer (scanned decode copies slices)
        cfg = preset_config(a)[0].replace(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                          scan_layers=False)
    else:
        cfg = DecoderConfig(**s, tie_embeddings=True, qk_norm=True, rope_theta=1_000_000.0,
                            max_position_embeddings=max(4096, ctx), dtype=jnp.bfloat16,
                            param_dtype=jnp.bfloat16)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    params = SamplingParams(temperature=0.0, max_tokens=a.new_tokens)
    rng = np.random.default_rng(0)
    rows = []
    for b in a.decode_batches:
        prompts = rng.integers(0, cfg.vocab_size, (b, a.prompt_len)).tolist()
        sampler = JaxSampler(model, max_context=ctx, max_batch=b, min_batch=b,
                             min_prefill_rows=b, min_cache_len=ctx, prefill_chunk=a.prompt_len,
                             steps_per_sync=a.steps_per_sync, max_top_logprobs=0,
                             prefix_reuse=False)

        def run():
            async def go():
                return await asyncio.gather(*(sampler.generate(p, params) for p in prompts))
            d0 = sampler.stats.decode_s
            t0 = time.perf_counter()
            res = asyncio.run(go())
            wall = time.perf_counter() - t0
            if any(len(r.output_ids) != a.new_tokens for r in res):
                raise RuntimeError("a row stopped before new_tokens")
            return wall, sampler.stats.decode_s - d0

        try:
            t0 = time.perf_counter()
            run()
            first = time.perf_counter() - t0
            runs = [run() for _ in range(a.repeats)]
        finally:
            sampler.close()
        wall = statistics.median(r[0] for r in runs)
        dec = statistics.median(r[1] for r in runs)
        n = b * a.new_tokens
        rows.append({"batch": b, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
                     "wall_s": wall, "tok_per_s": n / wall,
                     "ms_per_step": 1e3 * wall / a.new_tokens,
                     "decode_tok_per_s": n / dec, "decode_ms_per_step": 1e3 * dec / a.new_tokens,
                     "first_run_s": first})
        print(rows[-1], flush=True)
    return rows


def main(argv=None):
    a = parse(argv)
    if a.smoke:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.common import print_table, write_json

    backend = jax.default_backend()
    if backend != "gpu" and not a.smoke:
        raise SystemExit(f"gpu_bench: JAX sees no GPU (backend {backend!r}, devices "
                         f"{jax.devices()}); install jax with CUDA, or pass --smoke")
    dev = jax.devices()[0]
    s = shape(a)
    info = {"benchmark": "gpu_bench", "device": getattr(dev, "device_kind", str(dev)),
            "backend": backend, "smoke": a.smoke, "peak_tflops_assumed": a.peak_tflops,
            "shape": s, "matmul_params_M": matmul_params(s) / 1e6,
            "config": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(a).items()}}
    print(f"device: {info['device']} ({backend}); assumed peak {a.peak_tflops:g} TFLOP/s dense "
          f"bf16{' (H200 SXM spec)' if a.peak_tflops == H200_BF16_PEAK_TFLOPS else ''}", flush=True)
    print(f"shape: {s}; {info['matmul_params_M']:.1f}M matmul params", flush=True)
    t_all = time.perf_counter()
    if "matmul" not in a.skip:
        info["matmul"] = bench_matmul(a.matmul_n)
        print(f"bf16 matmul {a.matmul_n}^3: {info['matmul']['tflops']:.4g} TFLOP/s "
              f"({info['matmul']['tflops'] / a.peak_tflops:.1%} of assumed peak)", flush=True)
        write_json(a.out, info)
    if "train" not in a.skip:
        info["train"] = bench_train(a, s)
        print_table([info["train"]], ["params_M", "rows", "seq_len", "remat", "scan_layers",
                                      "attention_backend", "first_step_s", "step_s",
                                      "tokens_per_s", "achieved_tflops", "mfu", "mfu_6n_only",
                                      "peak_mem_GB", "dense_temp_GB", "chunked_temp_GB", "loss"])
        write_json(a.out, info)
    if "decode" not in a.skip:
        info["decode"] = bench_decode(a, s)
        print_table(info["decode"], ["batch", "prompt_len", "new_tokens", "wall_s", "tok_per_s",
                                     "ms_per_step", "decode_tok_per_s", "decode_ms_per_step",
                                     "first_run_s"])
        write_json(a.out, info)
    info["total_s"] = time.perf_counter() - t_all
    print(f"total {info['total_s']:.1f} s", flush=True)
    write_json(a.out, info)
    return info


if __name__ == "__main__":
    main()
