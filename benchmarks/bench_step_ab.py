"""Same-process A/B of the train step under two DecoderConfig runtime choices.

Both steps (bench_train_step's SFT step at a given size: forward, backward,
clipping, AdamW) are compiled first in one process, then timed alternately
A, B, A, B, ... so machine load hits both alike; reported are min and median
step seconds of each, the ratio B / A of both, and each side's first-step
loss (the choices change how, not what, the step computes).

    python -m benchmarks.bench_step_ab --sizes small,medium --rounds 8 \
        --a mlp_backward=autodiff --b mlp_backward=custom
    python -m benchmarks.bench_step_ab --sizes small --a "" --b "" \
        --xla_b xla_cpu_use_onednn=true

`--xla_a` / `--xla_b` give each side XLA options for its step's compile only
(`make_train_step(xla_options=)`; names from `XLA_FLAGS=--help`), so XLA:CPU's
options are compared in one process too (XLA_FLAGS would set them for both).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ac2_jax.models import Decoder  # noqa: E402
from ac2_jax.models.config import RUNTIME_FIELDS  # noqa: E402
from ac2_jax.segments import pack_segments  # noqa: E402
from ac2_jax.training import OptimizerConfig, SFTLoss, create_train_state, make_train_step  # noqa: E402
from ac2_jax.training.rl import rl_segment  # noqa: E402
from benchmarks.bench_train_step import CLIP, LR, SIZES, WD, config_of, tokens  # noqa: E402
from benchmarks.common import write_json  # noqa: E402


def parse_choices(text: str) -> dict:
    """"field=value,field=value" of DecoderConfig runtime fields -> dict (ints and bools parsed)."""
    out = {}
    for part in filter(None, text.split(",")):
        if "=" not in part:
            raise SystemExit(f"bad choice {part!r}: write field=value, e.g. mlp_backward=custom")
        k, v = part.split("=", 1)
        if k not in RUNTIME_FIELDS:
            raise SystemExit(f"{k!r} is not a runtime field of DecoderConfig; one of {RUNTIME_FIELDS}")
        out[k] = _scalar(v)
    return out


def _scalar(text: str):
    """A command-line value: an int, true / false as a bool, else the string."""
    if text.lstrip("-").isdigit():
        return int(text)
    return {"true": True, "false": False}.get(text.lower(), text)


def parse_xla_options(text: str) -> dict:
    """"name=value,..." of XLA debug options -> dict (ints and true/false parsed,
    other values kept as strings, e.g. enum names). A value may itself be a
    comma-separated list (xla_cpu_experimental_ynn_fusion_type=A,B): a part
    that is not xla_name=value continues the previous value."""
    raw = {}
    for part in filter(None, text.split(",")):
        k, eq, v = part.partition("=")
        if eq and k.startswith("xla_"):
            raw[k] = v
        elif raw and not k.startswith("xla_"):
            last = next(reversed(raw))
            raw[last] += "," + part
        else:
            raise SystemExit(f"bad XLA option {part!r}: write xla_name=value, e.g. "
                             "xla_cpu_use_onednn=true (names: XLA_FLAGS=--help)")
    return {k: _scalar(v) for k, v in raw.items()}


def compare(size: str, a: dict, b: dict, rounds: int, xla_a: dict | None = None,
            xla_b: dict | None = None) -> dict:
    """Min / median step seconds of variants a and b (DecoderConfig runtime choices,
    and XLA options of each step's compile) over `rounds` alternating steps."""
    base, (_, rows, seq_len) = config_of(size), SIZES[size]
    segs = [rl_segment(r, np.ones(seq_len), np.zeros(seq_len), task=f"t{i}")
            for i, r in enumerate(tokens(base, rows, seq_len))]
    batch = pack_segments(segs, seq_len)
    opt = OptimizerConfig(learning_rate=LR, weight_decay=WD, clip_norm=CLIP, b2=0.999)
    loss = SFTLoss(mode="token_mean", entropy=False)
    steps, states, losses = {}, {}, {}
    for side, choice, xla in (("a", a, xla_a), ("b", b, xla_b)):
        graphdef, state = create_train_state(Decoder(base.replace(**choice), rngs=nnx.Rngs(0)),
                                             opt)
        steps[side] = make_train_step(graphdef, loss, opt, donate=False, xla_options=xla)
        states[side] = steps[side].place(state)
        losses[side] = float(jax.block_until_ready(steps[side](states[side], batch)[1])["loss"])
    times = {"a": [], "b": []}
    for _ in range(rounds):
        for side in ("a", "b"):
            t0 = time.perf_counter()
            jax.block_until_ready(steps[side](states[side], batch)[1])
            times[side].append(time.perf_counter() - t0)
    out = {"size": size, "a": a, "b": b, "xla_a": xla_a or {}, "xla_b": xla_b or {},
           "loss_a": losses["a"], "loss_b": losses["b"]}
    for side in ("a", "b"):
        out[f"{side}_min_s"] = min(times[side])
        out[f"{side}_median_s"] = statistics.median(times[side])
    out["ratio_min"] = out["b_min_s"] / out["a_min_s"]
    out["ratio_median"] = out["b_median_s"] / out["a_median_s"]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="small,medium")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--a", default="mlp_backward=autodiff", help="variant A: field=value,...")
    p.add_argument("--b", default="mlp_backward=custom", help="variant B: field=value,...")
    p.add_argument("--xla_a", default="", help="XLA options of A's compile: xla_name=value,...")
    p.add_argument("--xla_b", default="", help="XLA options of B's compile: xla_name=value,...")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    a, b = parse_choices(args.a), parse_choices(args.b)
    xla_a, xla_b = parse_xla_options(args.xla_a), parse_xla_options(args.xla_b)
    rows = []
    for name in args.sizes.split(","):
        if name not in SIZES:
            raise SystemExit(f"unknown size {name!r}; choose from {sorted(SIZES)}")
        r = compare(name, a, b, args.rounds, xla_a, xla_b)
        rows.append(r)
        print(f"{name}: A {a} {xla_a} min {r['a_min_s'] * 1e3:.1f} ms median "
              f"{r['a_median_s'] * 1e3:.1f}; B {b} {xla_b} min {r['b_min_s'] * 1e3:.1f} ms median "
              f"{r['b_median_s'] * 1e3:.1f}; B/A min {r['ratio_min']:.3f} median "
              f"{r['ratio_median']:.3f} (load {os.getloadavg()[0]:.1f})", flush=True)
    write_json(args.out, {"benchmark": "step_ab", "rounds": args.rounds,
                          "loadavg": os.getloadavg(), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
