"""Where a compiled step's time goes: a jax.profiler trace, attributed by source.

Runs a jitted function a few times under `jax.profiler`, reads the Perfetto
trace (one event per executed XLA thunk: fusions, matmuls, copies) and
attributes each thunk to what produced it, from the compiled HLO's own
metadata: the Python call stack (`stack_frame_id` -> FileLocations ->
FunctionNames) and whether it is forward or backward (`transpose(jvp` in
`op_name`). Time is the sum of thunk durations over all threads, per step.

    python -m benchmarks.profile_step --sizes small,medium --steps 3
    python -m benchmarks.profile_step --what decode --sizes small

Categories (the innermost known function on the stack wins):
attention (scores, mask, softmax, weighted values), qkv/out projections,
mlp, lm head + log-probs, norms, rope, embedding, optimizer (optax),
loss/weights, other.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_step_ab import parse_choices  # noqa: E402
from benchmarks.common import parser, print_table, write_json  # noqa: E402

# (function name on the stack, category): first match from the innermost frame.
CATEGORIES = [
    ("attention_mask", "attention mask"), ("segment_attention_mask", "attention mask"),
    ("AttentionMask.dense", "attention mask"), ("AttentionMask.packed", "attention mask"),
    ("attention", "attention"), ("dense_attention", "attention"),
    ("blocksparse_attention", "attention"), ("_decode_step_attention", "attention"),
    ("apply_rope", "rope"), ("rope_cos_sin", "rope"), ("rotate", "rope"),
    ("Attention._proj", "qkv/out projections"),
    ("Attention.__call__", "qkv/out projections"), ("attention_apply", "qkv/out projections"),
    ("MLP.__call__", "mlp"), ("mlp_apply", "mlp"), ("_swiglu_fwd", "mlp"),
    ("_swiglu_bwd", "mlp"), ("swiglu", "mlp"), ("_linear_fwd", "qkv/out projections"),
    ("_linear_bwd", "qkv/out projections"), ("_proj", "qkv/out projections"),
    ("RMSNorm.__call__", "norms"), ("rms_norm", "norms"), ("Decoder.logits", "lm head"),
    ("LMHead.logits", "lm head"),
    ("token_logprobs", "log-probs (softmax over vocab)"),
    ("sampling_logits", "log-probs (softmax over vocab)"),
    ("chunked_token_logprobs", "log-probs (softmax over vocab)"),
    ("Decoder.embed", "embedding"), ("loss_weights", "loss / weights"),
    ("block_apply", "residual adds"), ("Block.__call__", "residual adds"),
]
_OPTAX = re.compile(r"optax")
# Control-flow thunks (a decode loop's `while`, a `cond`) span the thunks of their
# bodies, which the trace also records: counting both counted the loop twice.
_CONTAINER = re.compile(r"(while|conditional|call)(\.\d+)?$")


def _hlo_tables(text: str):
    """instruction name -> (category, direction, opcode-ish) from compiled HLO text."""
    sections = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    current = None
    for line in text.splitlines():
        if line.strip() in sections:
            current = sections[line.strip()]
            continue
        if current is not None:
            m = re.match(r"^(\d+) (.*)$", line)
            if not m:
                current = None
                continue
            current[int(m.group(1))] = m.group(2)
    files = {k: v.strip('"') for k, v in sections["FileNames"].items()}
    funcs = {k: v.strip('"') for k, v in sections["FunctionNames"].items()}
    locs = {k: tuple(int(x) for x in re.findall(r"(?:file_name_id|function_name_id)=(\d+)", v))
            for k, v in sections["FileLocations"].items()}
    frames = {k: tuple(int(x) for x in re.findall(r"=(\d+)", v))
              for k, v in sections["StackFrames"].items()}

    def stack(fid: int) -> list[tuple[str, str]]:
        out, seen = [], set()
        while fid in frames and fid not in seen:
            seen.add(fid)
            loc, parent = frames[fid]
            f, fn = locs.get(loc, (0, 0))
            out.append((files.get(f, ""), funcs.get(fn, "")))
            fid = parent
        return out  # innermost first

    def category(fid: int | None) -> str:
        if fid is None:
            return "other"
        st = stack(fid)
        for _, fn in st:
            for name, cat in CATEGORIES:
                if fn == name:
                    return cat
        if any(_OPTAX.search(f) for f, _ in st):
            return "optimizer"
        if any(fn == "_dot" for _, fn in st):  # a layer matmul whose stack stops at the helper
            return "projections + mlp (stack cut)"
        return "other"

    info = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?metadata=\{([^}]*)\}", text, re.M):
        if _CONTAINER.match(m.group(1)):
            continue
        meta = m.group(2)
        op = re.search(r'op_name="([^"]*)"', meta)
        fid = re.search(r"stack_frame_id=(\d+)", meta)
        op_name = op.group(1) if op else ""
        direction = "backward" if "transpose(jvp" in op_name else "forward"
        info[m.group(1)] = (category(int(fid.group(1)) if fid else None), direction, op_name)
    return info


def thunk_kind(name: str) -> str:
    """What an XLA:CPU thunk does, from its name: matmul (XNNPACK/YNNPACK fusions and
    dots), layout copy / transpose, or other (elementwise, reductions, loops)."""
    if re.match(r"(ynn|xnn)_fusion|dot|convolution|custom-call", name):
        return "matmul"
    if re.match(r"(copy|transpose|bitcast)", name):
        return "layout copy/transpose (+fused elementwise)"
    return "elementwise/reduce/other"


def profile(fn, args, steps: int = 3) -> dict:
    """Profiles `fn(*args)` (a jitted function, already warmed up) over `steps` calls.

    Returns per-category and per-direction milliseconds per step, the top
    thunks, and the wall time per step (outside the profiler).
    """
    text = fn.lower(*args).compile().as_text()
    info = _hlo_tables(text)
    t0 = time.perf_counter()
    for _ in range(steps):
        jax.block_until_ready(fn(*args))
    wall = (time.perf_counter() - t0) / steps
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        for _ in range(steps):
            jax.block_until_ready(fn(*args))
        jax.profiler.stop_trace()
        path = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)[0]
        with gzip.open(path) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    by_cat, by_dir, by_thunk, by_kind = (collections.Counter() for _ in range(4))
    matched = 0.0
    for e in events:
        if e.get("ph") != "X" or e.get("name") not in info:
            continue
        cat, direction, _ = info[e["name"]]
        ms = e.get("dur", 0.0) / 1e3 / steps
        by_cat[cat] += ms
        by_dir[direction] += ms
        by_thunk[e["name"]] += ms
        by_kind[thunk_kind(e["name"])] += ms
        matched += ms
    return {"wall_ms": wall * 1e3, "thunk_ms": matched, "by_category": dict(by_cat),
            "by_direction": dict(by_dir), "by_kind": dict(by_kind),
            "top_thunks": [(n, ms, info[n][0], info[n][2]) for n, ms in by_thunk.most_common(8)]}


def train_step_case(size: str, choices: dict | None = None):
    """(jitted step, args) for bench_train_step's size, one segment per row;
    `choices`: DecoderConfig runtime fields to override (e.g. mlp_backward)."""
    from benchmarks.bench_train_step import SIZES, config_of, jax_setup

    c, (_, rows, seq_len) = config_of(size).replace(**(choices or {})), SIZES[size]
    step, state, batch = jax_setup(c, rows, seq_len, donate=False)
    step(state, batch)  # builds and compiles
    return step._step, (state, batch, None, None), rows * seq_len  # (state, batch, extras, teacher)


def decode_case(size: str, batch: int = 16, chunk: int = 16):
    """(jitted decode of `chunk` single-token steps, args) at `batch` rows."""
    from flax import nnx

    from ac2_jax.models import Decoder
    from benchmarks.bench_train_step import config_of

    c = config_of(size)
    model = Decoder(c, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    cache = model.init_cache(batch, 512)

    @jax.jit
    def run(state, cache, tok, pos):
        m = nnx.merge(graphdef, state)

        def body(carry, _):
            cache, tok, pos = carry
            logits, cache = m.decode(tok, pos, cache)
            nxt = logits[:, -1].argmax(-1).astype(tok.dtype)[:, None]
            return (cache, nxt, pos + 1), None

        (cache, tok, pos), _ = jax.lax.scan(body, (cache, tok, pos), None, length=chunk)
        return tok

    tok = np.zeros((batch, 1), np.int32)
    pos = np.full((batch, 1), 64, np.int32)
    args = (state, cache, tok, pos)
    jax.block_until_ready(run(*args))
    return run, args, batch * chunk


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--what", default="train", choices=["train", "decode"])
    p.add_argument("--sizes", default="small,medium")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=16, help="decode rows")
    p.add_argument("--model_config", default="",
                   help="train: DecoderConfig runtime fields, e.g. mlp_backward=autodiff")
    args = p.parse_args(argv)
    out, rows = {}, []
    for size in args.sizes.split(","):
        fn, fargs, toks = (train_step_case(size, parse_choices(args.model_config))
                           if args.what == "train"
                           else decode_case(size, args.batch))
        r = profile(fn, fargs, args.steps)
        r["tokens"] = toks
        out[size] = r
        total = sum(r["by_category"].values()) or 1.0
        for cat, ms in sorted(r["by_category"].items(), key=lambda kv: -kv[1]):
            rows.append({"size": size, "category": cat, "ms_per_step": ms,
                         "share": ms / total})
        for d, ms in list(r["by_direction"].items()) + list(r["by_kind"].items()):
            rows.append({"size": size, "category": f"[{d}]", "ms_per_step": ms,
                         "share": ms / total})
        print(f"{size}: wall {r['wall_ms']:.1f} ms/step, thunk time (all threads) "
              f"{r['thunk_ms']:.1f} ms/step; top thunks:")
        for name, ms, cat, op in r["top_thunks"]:
            print(f"  {name:32s} {ms:8.2f} ms  {cat:28s} {op[:70]}")
    print_table(rows, ["size", "category", "ms_per_step", "share"])
    write_json(args.out, {"benchmark": f"profile_{args.what}", "results": out})
    return out


if __name__ == "__main__":
    main()
