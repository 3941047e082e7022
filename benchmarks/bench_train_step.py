"""Train-step throughput: our jitted step vs transformers + torch (CPU), same Qwen3 config.

Each side runs full training steps (forward, backward, global-norm clip, AdamW)
in fp32 on [rows, seq_len] batches of one segment per row. Reported: tokens/s,
achieved GFLOP/s with FLOPs = 6 * matmul params * tokens + 12 * layers *
heads * head_dim * seq_len * tokens (attention scores and values over the full
L x L, as both implementations compute them), and that rate as a fraction of
the fp32 XLA matmul roofline measured in the same run (bench_roofline). With
torch, the run ends by measuring this machine's GEMM ceiling (the best fp32
[n, n] GEMM rate of XLA, numpy's BLAS and torch at --ceiling_sizes) and says,
per size, whether 1.5x torch's step is reachable at equal FLOPs: it needs 1.5x
torch's GFLOP/s, which no step can exceed the ceiling by.

    python -m benchmarks.bench_train_step --sizes tiny,small,medium --out bench_results/train_step.json
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ac2_jax.models import Decoder, DecoderConfig  # noqa: E402
from ac2_jax.segments import pack_segments  # noqa: E402
from ac2_jax.training import OptimizerConfig, SFTLoss, create_train_state, make_train_step  # noqa: E402
from ac2_jax.training.rl import rl_segment  # noqa: E402
from benchmarks.bench_roofline import gemm_ceiling, roofline  # noqa: E402
from benchmarks.common import WIDTHS, parser, print_table, write_json  # noqa: E402

SIZES = {  # name: (DecoderConfig overrides, rows, seq_len)
    "tiny": (dict(vocab_size=512, **WIDTHS["tiny"]), 8, 128),
    "small": (dict(vocab_size=2048, **WIDTHS["small"]), 4, 256),
    "medium": (dict(vocab_size=4096, **WIDTHS["medium"]), 4, 256),
}
LR, WD, CLIP = 1e-4, 0.1, 1.0


def config_of(name: str) -> DecoderConfig:
    return DecoderConfig(tie_embeddings=True, qk_norm=True, rope_theta=10000.0,
                         max_position_embeddings=4096, **SIZES[name][0])


def matmul_params(c: DecoderConfig) -> int:
    """Weights that take part in a matmul per token (lm head; no norms, no lookup)."""
    attn = c.hidden_size * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    return c.num_layers * (attn + mlp) + c.vocab_size * c.hidden_size


def step_flops(c: DecoderConfig, rows: int, seq_len: int) -> float:
    tokens = rows * seq_len
    attn = 12 * c.num_layers * c.num_heads * c.head_dim * seq_len * tokens
    return 6.0 * matmul_params(c) * tokens + attn


def tokens(c: DecoderConfig, rows: int, seq_len: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, c.vocab_size, (rows, seq_len)).astype(np.int32)


def jax_setup(c: DecoderConfig, rows: int, seq_len: int, donate: bool = True):
    """(step, placed state, batch): the jitted SFT step of this benchmark, one
    segment per row, AdamW + clipping (also bench_matmul_ceiling's and bench_step_ab's)."""
    ids = tokens(c, rows, seq_len)
    segs = [rl_segment(r, np.ones(seq_len), np.zeros(seq_len), task=f"t{i}")
            for i, r in enumerate(ids)]
    batch = pack_segments(segs, seq_len)
    opt = OptimizerConfig(learning_rate=LR, weight_decay=WD, clip_norm=CLIP, b2=0.999)
    graphdef, state = create_train_state(Decoder(c, rngs=nnx.Rngs(0)), opt)
    step = make_train_step(graphdef, SFTLoss(mode="token_mean", entropy=False), opt,
                           donate=donate)
    return step, step.place(state), batch


def bench_jax(c: DecoderConfig, rows: int, seq_len: int, steps: int) -> dict:
    step, state, batch = jax_setup(c, rows, seq_len)
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = step(state, batch)
    jax.block_until_ready(m)
    return {"seconds": (time.perf_counter() - t0) / steps, "first_step_s": compile_s,
            "loss": float(m["loss"])}


def torch_setup(c: DecoderConfig, rows: int, seq_len: int):
    """A closure running one transformers + torch train step (forward, backward,
    clipping, AdamW) on this benchmark's batch; returns the loss."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**c.to_hf_config()))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, betas=(0.9, 0.999))
    ids = torch.from_numpy(tokens(c, rows, seq_len).astype(np.int64))

    def one():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    return one


def bench_torch(c: DecoderConfig, rows: int, seq_len: int, steps: int) -> dict:
    import torch

    one = torch_setup(c, rows, seq_len)
    t0 = time.perf_counter()
    one()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = one()
    return {"seconds": (time.perf_counter() - t0) / steps, "first_step_s": first, "loss": loss,
            "torch_threads": torch.get_num_threads()}


def goal_rows(rows: list[dict], ceiling_gflops: float, goal: float = 1.5) -> list[dict]:
    """Per size: the GFLOP/s a step `goal` x torch's would run at, against the ceiling."""
    out = []
    for r in rows:
        if r["impl"] != "transformers+torch":
            continue
        need = goal * r["gflops"]
        out.append({"size": r["size"], "torch_gflops": r["gflops"], "goal_gflops": need,
                    "goal_over_ceiling": need / ceiling_gflops,
                    "reachable_at_equal_flops": need <= ceiling_gflops})
    return out


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", default="tiny,small,medium")
    p.add_argument("--steps", type=int, default=3, help="timed steps per size (after 1 warm-up)")
    p.add_argument("--no_torch", action="store_true")
    p.add_argument("--roofline_sizes", default="512,1024")
    p.add_argument("--ceiling_sizes", default="1024,2048",
                   help="GEMM sizes of the ceiling check (with torch); empty: skip it")
    args = p.parse_args(argv)
    peak = roofline([int(n) for n in args.roofline_sizes.split(",")], 0.5)["peak_gflops"]
    rows_out = []
    for name in args.sizes.split(","):
        if name not in SIZES:
            raise SystemExit(f"unknown size {name!r}; choose from {sorted(SIZES)}")
        c, (_, rows, seq_len) = config_of(name), SIZES[name]
        flops = step_flops(c, rows, seq_len)
        impls = [("ac2_jax (jit)", bench_jax)]
        if not args.no_torch:
            impls.append(("transformers+torch", bench_torch))
        for impl, fn in impls:
            r = fn(c, rows, seq_len, args.steps)
            gflops = flops / r["seconds"] / 1e9
            rows_out.append({
                "size": name, "impl": impl, "params_M": matmul_params(c) / 1e6,
                "tokens": rows * seq_len, "step_s": r["seconds"],
                "tokens_per_s": rows * seq_len / r["seconds"], "gflops": gflops,
                "frac_roofline": gflops / peak, "first_step_s": r["first_step_s"],
                "loss": r["loss"]})
    print(f"roofline (fp32 XLA matmul peak): {peak:.1f} GFLOP/s")
    print_table(rows_out, ["size", "impl", "params_M", "tokens", "step_s", "tokens_per_s",
                           "gflops", "frac_roofline", "first_step_s"])
    ceiling = None
    if not args.no_torch and args.ceiling_sizes:
        # Last: OpenBLAS's spinning threads would slow the XLA steps timed after it.
        ceiling = gemm_ceiling([int(n) for n in args.ceiling_sizes.split(",")],
                               min_seconds=0.5)
        ceiling["goals"] = goal_rows(rows_out, ceiling["ceiling_gflops"])
        lib, n = ceiling["ceiling_by"]
        print(f"\nGEMM ceiling: {ceiling['ceiling_gflops']:.1f} GFLOP/s ({lib}, n = {n})")
        print_table(ceiling["goals"], ["size", "torch_gflops", "goal_gflops", "goal_over_ceiling",
                                       "reachable_at_equal_flops"])
    write_json(args.out, {"benchmark": "train_step", "roofline_gflops": peak,
                          "steps": args.steps, "rows": rows_out, "ceiling": ceiling})
    return rows_out


if __name__ == "__main__":
    main()
