"""One fp32 RL step per model family at a real shape: peak RSS of a child process (issue 34).

    python -m benchmarks.family_memory --shapes gemma3-1b,qwen3-30b-a3b:1:32 --tokens 1024 \\
        --steps 2 --out /tmp/family_memory.json

Per shape: a random HF checkpoint from transformers' own config class (the published
config.json sizes; ``NAME:L`` cuts it to L layers, ``NAME:L:E`` a MoE shape also to E
experts) written by a child process, then `benchmarks.bench_real_size`'s ``jax_default``
case in another child: ``load_hf_checkpoint(ckpt)`` with every default (the memory plan
picks scan / remat / attention kernel / log-prob chunking; its log lines come back in
the row), ``PolicyGradientLoss()``, AdamW, fp32, one packed row of ``--tokens`` tokens,
``--steps`` steps (the first compiles). Peak RSS is that child's VmHWM.

Memory safety (the machine is shared with other real-size benchmarks): every child
runs under ``flock --lock`` and starts only once /proc/meminfo's MemAvailable covers
its need (the step: 19 bytes per parameter + 1 GB, from the Qwen2.5 / Mistral rows of
BUILD_NOTES; the writer: 9 bytes per parameter + 1 GB), waiting up to ``--wait_s``;
else the row records why it did not run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks import bench_real_size  # noqa: E402
from benchmarks.common import machine, parser, print_table, write_json  # noqa: E402

LOCK = "/tmp/ac2_realsize.lock"
S, F = "sliding_attention", "full_attention"

SHAPES = {
    # google/gemma-3-1b-pt config.json (as shipped: sliding_window_pattern 6 = 5 sliding : 1 full)
    "gemma3-1b": ("Gemma3TextConfig", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        query_pre_attn_scalar=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
        layer_types=[F if (i + 1) % 6 == 0 else S for i in range(26)],
        rope_parameters={F: {"rope_type": "default", "rope_theta": 1_000_000.0},
                         S: {"rope_type": "default", "rope_theta": 10_000.0}},
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)),
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False)),
    # toy shapes of the same structure (tests/benchmarks/test_family_memory.py)
    "gemma3-tiny": ("Gemma3TextConfig", dict(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=8, sliding_window=8,
        query_pre_attn_scalar=8, max_position_embeddings=512, layer_types=[S, S, S, F])),
    "qwen3-moe-tiny": ("Qwen3MoeConfig", dict(
        vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
        tie_word_embeddings=False)),
}  # fmt: skip


def shape_kwargs(spec: str) -> tuple[str, dict]:
    """(config class name, config kwargs) of ``NAME[:layers[:experts]]``."""
    name, *cut = spec.split(":")
    cls, kw = SHAPES[name]
    kw = dict(kw)
    if cut and int(cut[0]):
        n = int(cut[0])
        kw["num_hidden_layers"] = n
        if "layer_types" in kw:
            kw["layer_types"] = kw["layer_types"][:n]
    if len(cut) > 1 and int(cut[1]):
        if "num_experts" not in kw:
            raise SystemExit(f"{spec}: only a MoE shape takes an expert count")
        kw["num_experts"] = int(cut[1])
        kw["num_experts_per_tok"] = min(kw["num_experts_per_tok"], int(cut[1]))
    return cls, kw


def count_params(spec: str) -> int:
    """Parameters of the shape, from transformers' model on the meta device (no memory)."""
    import torch
    import transformers

    cls, kw = shape_kwargs(spec)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw))
    seen = {id(p): p.numel() for p in model.parameters()}  # a tied head counts once
    return int(sum(seen.values()))


def write_checkpoint(spec: str, out: str) -> dict:
    """A random fp32 HF checkpoint of the shape (transformers' init, seed 0) in `out`."""
    import torch
    import transformers

    cls, kw = shape_kwargs(spec)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, cls)(**kw), dtype=torch.float32
    )
    model.save_pretrained(out)
    return {"architecture": type(model).__name__, "layers": kw["num_hidden_layers"]}


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def gate(need_bytes: int, wait_s: float, cmd: list[str]) -> None:
    """Runs `cmd` in place of this process (exec: its VmHWM starts afresh) once
    MemAvailable >= need_bytes; exits 75 after `wait_s` seconds without it."""
    deadline = time.monotonic() + wait_s
    while (have := mem_available_bytes()) < need_bytes:
        if time.monotonic() > deadline:
            print(
                f"GATE MemAvailable {have / 1e9:.2f} GB < need {need_bytes / 1e9:.2f} GB "
                f"after {wait_s:.0f} s",
                flush=True,
            )
            sys.exit(75)
        time.sleep(5)
    os.execvp(cmd[0], cmd)


def _guarded(cmd: list[str], lock: str, need: int, wait_s: float, timeout: float):
    """`cmd` under flock `lock`, started once MemAvailable covers `need` bytes."""
    full = [
        "flock",
        lock,
        sys.executable,
        "-m",
        "benchmarks.family_memory",
        "--gate",
        str(need),
        "--wait_s",
        str(wait_s),
        "--",
        *cmd,
    ]
    return subprocess.run(full, capture_output=True, text=True, timeout=timeout)


def run_shape(spec: str, args, workdir: str) -> dict:
    params = count_params(spec)
    step_need = int(19 * params + 1e9)
    row: dict = {
        "shape": spec,
        "params": params,
        "tokens": args.tokens,
        "need_gb": round(step_need / 1e9, 2),
    }
    ckpt = os.path.join(workdir, spec.replace(":", "_"))
    py = [sys.executable, "-m", "benchmarks.family_memory"]
    try:
        r = _guarded(
            [*py, "--write", spec, "--ckpt", ckpt],
            args.lock,
            int(9 * params + 1e9),
            args.wait_s,
            args.timeout,
        )
        if r.returncode != 0:
            row["error"] = f"writer exit {r.returncode}: {(r.stdout + r.stderr)[-300:]}"
            return row
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.bench_real_size",
            "--child",
            "1",
            "--case",
            "jax_default",
            "--n",
            str(args.tokens),
            "--ckpt",
            ckpt,
            "--steps",
            str(args.steps),
        ]
        r = _guarded(cmd, args.lock, step_need, args.wait_s, args.timeout)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if r.returncode == 0 and line:
            row.update(json.loads(line[-1][len("RESULT ") :]))
        else:  # e.g. killed for memory (-9), or the gate gave up (75): recorded, not hidden
            row["error"] = f"exit {r.returncode}: {(r.stdout + r.stderr)[-300:]}"
    except subprocess.TimeoutExpired:
        row["error"] = f"timeout after {args.timeout}s"
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    return row


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--gate" in argv:  # python -m benchmarks.family_memory --gate BYTES --wait_s S -- CMD
        sep = argv.index("--")
        opts = dict(zip(argv[:sep:2], argv[1:sep:2], strict=True))
        gate(int(opts["--gate"]), float(opts["--wait_s"]), argv[sep + 1 :])
    p = parser(__doc__.splitlines()[0])
    p.add_argument(
        "--shapes",
        default="gemma3-1b,qwen3-30b-a3b:1:32",
        help="NAME[:layers[:experts]] of " + ", ".join(SHAPES),
    )
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2, help="RL steps per shape (the first compiles)")
    p.add_argument("--lock", default=LOCK, help="flock file every child runs under")
    p.add_argument("--wait_s", type=float, default=1800, help="most seconds to wait for memory")
    p.add_argument("--timeout", type=float, default=7200)
    p.add_argument("--workdir", default=None, help="checkpoints go here (default: a temp dir)")
    p.add_argument("--write", default=None, help=bench_real_size.argparse_hidden())
    p.add_argument("--ckpt", default=None, help=bench_real_size.argparse_hidden())
    args = p.parse_args(argv)
    if args.write:
        print("WROTE " + json.dumps(write_checkpoint(args.write, args.ckpt)), flush=True)
        return None
    print(json.dumps({"machine": machine()}), flush=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        rows = []
        for spec in args.shapes.split(","):
            rows.append(run_shape(spec, args, workdir))
            print(json.dumps(rows[-1]), flush=True)
    print_table(
        rows,
        ["shape", "params", "tokens", "peak_rss_gb", "first_step_s", "step_s", "loss", "error"],
    )
    write_json(args.out, {"benchmark": "family_memory", "rows": rows})
    return rows


if __name__ == "__main__":
    main()
