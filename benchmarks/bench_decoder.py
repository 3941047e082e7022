"""Decoder benchmark: compile time with and without scanned layers, and block-sparse
vs dense attention on packed rows (tiles computed and time).

(a) Compile: the jitted value-and-grad of the mean token log-prob of a
    `--layers`-deep, `--hidden`-wide decoder (fp32), per-layer (Python loop)
    vs scanned (`scan_layers=True`), each with remat "none" and "full".
    Lowering and compiling are timed separately; the step is timed too
    (`--abstract`: compile only, e.g. Qwen3-0.6B's shape with `--hidden 1024
    --compile_heads 16 8 128 --compile_vocab 151936`).
(b) Attention: one packed row of `--seq_len` tokens at Qwen3's head layout
    (16 query heads, 8 KV heads of 128): a flat row of `--segments` equal
    segments, one segment (causal), and a GRPO group as a tree row (a
    prompt of seq_len/4 and 8 branches). For each: tiles the block-sparse
    kernel computed (its loop's own count) vs the dense tile count, and the
    forward + backward time of both kernels.
(c) With `--parity VARIANT`: a random checkpoint of that preset of
    experiments/configs/qwen3.py (e.g. "default", Qwen3-0.6B) written by
    transformers, loaded with the preset's runtime choices (scanned layers):
    max |logit difference| to transformers on a short input, and the times.

    python -m benchmarks.bench_decoder --parity default --out bench_results/decoder.json
"""

from __future__ import annotations

import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ac2_jax.losses import token_logprobs
from ac2_jax.models import (AttentionMask, Decoder, DecoderConfig,
                            blocksparse_attention_with_count, dense_attention)
from benchmarks.common import parser, print_table, time_fn, write_json


def random_decoder(cfg: DecoderConfig, seed: int = 0):
    """(graphdef, params) with N(0, 0.02) matrices and unit norms, filled from numpy on an
    abstract model (eager init compiles one random op per shape)."""
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg)))
    leaves = []
    for key, var in nnx.to_flat_state(state):
        norm = any("norm" in str(part) for part in key)
        value = (np.ones(var.shape, np.float32) if norm
                 else 0.02 * rng.standard_normal(var.shape, dtype=np.float32))
        leaves.append((key, var.replace(jnp.asarray(value, var.dtype))))
    return graphdef, nnx.from_flat_state(leaves)


def compile_rows(layers: int, hidden: int, seq_len: int, repeats: int,
                 remats=("none", "full"), scans=(False, True), heads=(4, 2, None),
                 vocab: int = 256, abstract: bool = False) -> list[dict]:
    """Lower / compile times of the loss's value-and-grad per layout and remat; with
    `abstract` the params are shapes only (no memory; no step time)."""
    H, K, hd = heads
    rows = []
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 256, (1, seq_len)), jnp.int32)
    pos = jnp.arange(seq_len)[None]
    seg = jnp.ones((1, seq_len), jnp.int32)
    for scan in scans:
        for remat in remats:
            cfg = DecoderConfig(vocab_size=vocab, hidden_size=hidden,
                                intermediate_size=3 * hidden, num_layers=layers, num_heads=H,
                                num_kv_heads=K, head_dim=hd or hidden // H, scan_layers=scan,
                                remat=remat, attention_backend="dense")
            if abstract:
                graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(cfg)))
            else:
                graphdef, params = random_decoder(cfg)

            def loss(p):
                return token_logprobs(nnx.merge(graphdef, p)(tokens, pos, seg), tokens).mean()

            fn = jax.jit(jax.value_and_grad(loss))
            t0 = time.perf_counter()
            lowered = fn.lower(params)
            t1 = time.perf_counter()
            compiled = lowered.compile()
            t2 = time.perf_counter()
            step = None if abstract else time_fn(
                lambda: jax.block_until_ready(compiled(params)), repeats)["median_s"]
            rows.append({"layers": layers, "hidden": hidden, "scan": scan, "remat": remat,
                         "lower_s": t1 - t0, "compile_s": t2 - t1,
                         "hlo_chars": len(lowered.as_text()), "step_s": step})
    return rows


def packed_rows(seq_len: int, segments: int) -> dict[str, AttentionMask]:
    """The attention masks of the benchmark's rows (one row each)."""
    flat = np.repeat(np.arange(1, segments + 1), seq_len // segments)
    flat = np.pad(flat, (0, seq_len - len(flat)))[None]
    prompt, n = seq_len // 4, 8
    resp = (seq_len - prompt) // n
    sub = np.arange(seq_len)
    sub[:prompt] = prompt + n * resp - 1  # the prompt is every branch's ancestor
    for b in range(n):
        a = prompt + b * resp
        sub[a:a + resp] = a + resp - 1  # each branch token: itself to its branch's end
    tree_seg = (np.arange(seq_len) < prompt + n * resp).astype(np.int32)
    return {"segmented": AttentionMask.packed(jnp.asarray(flat, jnp.int32)),
            "causal": AttentionMask.packed(jnp.ones((1, seq_len), jnp.int32)),
            "tree_group8": AttentionMask.packed(jnp.asarray(tree_seg[None]),
                                                jnp.asarray(sub[None], jnp.int32))}


def attention_rows(seq_len: int, segments: int, block: int, repeats: int,
                   heads=(16, 8, 128), names=None) -> list[dict]:
    H, K, hd = heads
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.standard_normal((1, seq_len, H, hd)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, seq_len, K, hd)), jnp.float32) for _ in "kv")
    rows = []
    for name, mask in packed_rows(seq_len, segments).items():
        if names is not None and name.split("_")[0] not in names:
            continue
        label = f"flat_{segments}seg" if name == "segmented" else name
        def sparse(q, k, v, mask=mask):
            return blocksparse_attention_with_count(q, k, v, mask, block_q=block, block_k=block)

        def dense(q, k, v, mask=mask):
            return dense_attention(q, k, v, mask.dense()), jnp.int32(0)

        row = {"row": label, "tokens": seq_len, "block": block,
               "dense_tiles": (-(-seq_len // block)) ** 2}
        for kernel, fn in (("sparse", sparse), ("dense", dense)):
            fwd = jax.jit(fn)
            grad = jax.jit(jax.grad(lambda q, k, v, fn=fn: fn(q, k, v)[0].sum(), (0, 1, 2)))
            out, count = fwd(q, k, v)
            if kernel == "sparse":
                row["sparse_tiles"], ref = int(count), out
            else:
                row["max_abs_diff"] = float(jnp.abs(out - ref).max())
            row[f"{kernel}_fwd_s"] = time_fn(lambda: jax.block_until_ready(fwd(q, k, v)),
                                             repeats)["median_s"]
            row[f"{kernel}_fwd_bwd_s"] = time_fn(lambda: jax.block_until_ready(grad(q, k, v)),
                                                 repeats)["median_s"]
        row["tile_fraction"] = row["sparse_tiles"] / row["dense_tiles"]
        row["speedup_fwd_bwd"] = row["dense_fwd_bwd_s"] / row["sparse_fwd_bwd_s"]
        rows.append(row)
    return rows


def parity_row(variant: str, tokens: int = 32) -> dict:
    """Logits of a random checkpoint of preset `variant` vs transformers (fp32)."""
    import torch
    import transformers

    from experiments.configs.qwen3 import get_config
    from experiments.real_size import load_preset, write_random_checkpoint

    cfg = get_config(variant)
    if cfg.model.dtype != "float32":
        raise ValueError(f"--parity compares fp32 logits; preset {variant!r} computes in "
                         f"{cfg.model.dtype}")
    with tempfile.TemporaryDirectory() as path:
        t0 = time.perf_counter()
        write_random_checkpoint(cfg.shape, path, seed=0)
        t1 = time.perf_counter()
        model, config = load_preset(cfg, path)
        t2 = time.perf_counter()
        ids = np.random.default_rng(2).integers(0, config.vocab_size, tokens)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            ref = hf(torch.tensor(ids[None])).logits[0].numpy()
        del hf
    t = jnp.asarray(ids[None], jnp.int32)
    fwd = nnx.jit(lambda m: m(t, jnp.arange(tokens)[None], jnp.ones_like(t)))
    t3 = time.perf_counter()
    ours = np.asarray(fwd(model))[0]
    t4 = time.perf_counter()
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return {"variant": variant, "params": n, "layers": config.num_layers,
            "scan": config.scan_layers, "tokens": tokens, "write_s": t1 - t0,
            "load_s": t2 - t1, "first_forward_s": t4 - t3,
            "max_abs_diff": float(np.abs(ours - ref).max())}


def main(argv=None) -> dict:
    p = parser(__doc__)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--compile_seq_len", type=int, default=128)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--segments", type=int, default=16)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--heads", type=int, nargs=3, default=(16, 8, 128),
                   metavar=("H", "K", "HEAD_DIM"))
    p.add_argument("--remats", nargs="+", default=["none", "full"],
                   choices=["none", "full", "save_dots"])
    p.add_argument("--layouts", nargs="+", default=["per_layer", "scan"],
                   choices=["per_layer", "scan"])
    p.add_argument("--compile_heads", type=int, nargs=3, default=(4, 2, 16),
                   metavar=("H", "K", "HEAD_DIM"))
    p.add_argument("--compile_vocab", type=int, default=256)
    p.add_argument("--abstract", action="store_true",
                   help="compile only, with abstract params (real-size shapes in no memory)")
    p.add_argument("--parity", default=None, help="a variant of experiments/configs/qwen3.py")
    p.add_argument("--rows", nargs="+", default=["segmented", "causal", "tree"],
                   choices=["segmented", "causal", "tree"],
                   help="segmented: --segments equal segments; causal: one segment; tree: "
                        "the GRPO group")
    args = p.parse_args(argv)
    compile_table = compile_rows(args.layers, args.hidden, args.compile_seq_len, args.repeats,
                                 tuple(args.remats),
                                 tuple(layout == "scan" for layout in args.layouts),
                                 tuple(args.compile_heads), args.compile_vocab, args.abstract)
    print_table(compile_table, ["layers", "hidden", "scan", "remat", "lower_s", "compile_s",
                                "hlo_chars", "step_s"])
    attn_table = attention_rows(args.seq_len, args.segments, args.block, args.repeats,
                                tuple(args.heads), set(args.rows))
    print()
    print_table(attn_table, ["row", "tokens", "sparse_tiles", "dense_tiles", "tile_fraction",
                             "sparse_fwd_s", "dense_fwd_s", "sparse_fwd_bwd_s",
                             "dense_fwd_bwd_s", "speedup_fwd_bwd", "max_abs_diff"])
    result = {"benchmark": "decoder", "args": vars(args), "compile": compile_table,
              "attention": attn_table}
    if args.parity:
        result["parity"] = parity_row(args.parity)
        print()
        print_table([result["parity"]], list(result["parity"]))
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
