"""A real-size policy on one machine: peak RSS and time of one train step, side by side.

Each case runs in its own child process (peak RSS = the child's VmHWM):

* ``jax_rl``: one RL step (PolicyGradientLoss: PPO clip + TIS, task_mean,
  AdamW, fp32) on one packed row of ``tokens`` tokens, from a random HF
  checkpoint of the preset (experiments/real_size/qwen3.py: Qwen3-0.6B shape by
  default) loaded with the preset's runtime choices (scanned layers, remat,
  block-sparse attention) and chunked log-probs (``--chunk``).
* ``jax_default``: the same RL step with every default and no preset named:
  ``load_hf_checkpoint(ckpt)``, ``PolicyGradientLoss()``, ``make_train_step(graphdef,
  loss, opt)``, ``step(state, batch)`` (no ``place``). The memory plan
  (``ac2_jax.models.memory_plan``) picks scan, remat, the attention kernel and the
  log-prob chunking; the lines it logged are in the row (``plan``).
* ``jax_opsd``: one OPSD step (reverse KL to the live teacher, which runs
  inside the step on a prompt with a 32-token hint), same settings.
* ``torch``: transformers + torch, the same checkpoint, one step of
  cross-entropy + AdamW in fp32 on the same tokens (the loss torch users
  run; no PPO terms).
* ``jax_sched``: the jax_rl step compiled with the memory-optimized XLA:CPU
  scheduler and with the default one, alternating in one process on the
  preset's shape cut to ``--sched_layers`` layers: the step-time ratio.
* ``jax_decode``: the JaxSampler (per-layer weights) at batch ``--decode_batch``:
  output tokens/s of a second batch of 64-token prompts (the first compiles),
  ``--decode_tokens`` new tokens per row.

Peak RSS is the child's VmHWM (its own address space); ``rss_timeline`` lists
(phase, VmRSS GB, VmHWM GB) after each phase, and the jax train cases report
XLA's memory analysis of the compiled step (``xla_bytes``: argument, output,
donated alias and temporary bytes, compiled from an abstract state before any
weights load).

    python -m benchmarks.bench_real_size --tokens 1024,4096 --cases jax_rl,jax_opsd,torch
    python -m benchmarks.bench_real_size --tokens 1024 --cases jax_default,torch --steps 2
    python -m benchmarks.bench_real_size --variant tiny --tokens 64   (a smoke run)
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.common import machine, parser, print_table, write_json  # noqa: E402

CASES = ("jax_rl", "jax_default", "jax_opsd", "torch", "jax_decode", "jax_sched")


def _tokens(n: int, vocab: int, seed: int = 0):
    import numpy as np
    return np.random.default_rng(seed).integers(0, vocab, n).astype(np.int32)


def _mark(timeline: list, phase: str) -> None:
    """Appends (phase, VmRSS GB, VmHWM GB): where the process's memory goes, phase by phase."""
    rss, hwm = _status_kb("VmRSS"), _status_kb("VmHWM")
    timeline.append([phase, round(rss / 1e9, 3), round(hwm / 1e9, 3)])


def _status_kb(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _jax_problem(case: str, config, n: int, chunk: int):
    """(batch, extras, loss) of one `case` row of n tokens."""
    import numpy as np

    from ac2_jax.segments import pack_segments
    from ac2_jax.training import PolicyGradientLoss
    from ac2_jax.training.distill.data import DistillExample, pack_pairs
    from ac2_jax.training.distill.loss import DistillLoss, teacher_extras
    from ac2_jax.training.rl import rl_segment

    ids = _tokens(n, config.vocab_size)
    if case == "jax_rl":
        half = n // 2
        seg = rl_segment(ids, np.r_[np.zeros(half), np.ones(n - half)], np.full(n, -1.0),
                      task="t0", advantage=1.0)
        return pack_segments([seg], n), None, PolicyGradientLoss(mode="task_mean",
                                                                 chunk_size=chunk or None)
    hint = _tokens(32, config.vocab_size, seed=1).tolist()
    # Student: prompt (n/4) + response; teacher: 32 hint tokens + the same; <= n each.
    prompt, resp = ids[: n // 4].tolist(), ids[n // 4: n - 32].tolist()
    ex = DistillExample(prompt, hint + prompt, resp, "hint", "t0", hint_span=(0, 32))
    paired = pack_pairs([ex], n)
    return paired.student, teacher_extras(paired), DistillLoss(mode="task_mean",
                                                               chunk_size=chunk or None)


def step_memory(step, abstract_state, batch, extras) -> dict:
    """XLA's own accounting of the compiled step (bytes), from an abstract state (no
    parameter memory): arguments, outputs, donated (aliased) and temporary bytes."""
    ma = step.lower(abstract_state, batch, extras).compile().memory_analysis()
    return {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias",
                                                                "temp")}


def _jax_step(case: str, ckpt: str, variant: str, n: int, chunk: int, steps: int,
              memory_scheduler: bool = True, place_copy: bool = False) -> dict:
    import jax
    from flax import nnx

    from ac2_jax.models.decoder import Decoder
    from ac2_jax.models.io.hf_io import load_hf_config
    from ac2_jax.training import OptimizerConfig, create_train_state, make_train_step
    from ac2_jax.training.core import abstract_train_state
    from experiments.real_size import qwen3
    from experiments.real_size.checkpoint import load_preset, preset_runtime

    timeline: list = []
    _mark(timeline, "start")
    cfg = qwen3.get_config(variant)
    opt = OptimizerConfig(learning_rate=1e-6, weight_decay=0.1, clip_norm=1.0)
    config = load_hf_config(ckpt, **preset_runtime(cfg))
    batch, extras, loss = _jax_problem(case, config, n, chunk)
    graphdef, abstract = abstract_train_state(lambda: Decoder(config, rngs=nnx.Rngs(0)), opt)
    step = make_train_step(graphdef, loss, opt, cpu_memory_scheduler=memory_scheduler)
    xla = step_memory(step, abstract, batch, extras)
    _mark(timeline, "abstract compile (memory_analysis)")
    t0 = time.perf_counter()
    model, config = load_preset(cfg, ckpt)
    load_s = time.perf_counter() - t0
    _mark(timeline, "load checkpoint")
    graphdef, state = create_train_state(model, opt)
    del model
    _mark(timeline, "create_train_state")
    # copy=False: the step takes the state over (copy=True keeps the caller's arrays
    # alive beside the donated ones: a second 7.2 GB while both exist).
    state = step.place(state, copy=place_copy)
    _mark(timeline, "place")
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batch, extras)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
        _mark(timeline, f"step {i + 1}")
    return {"load_s": load_s, "first_step_s": times[0], "step_s": times[-1] if steps > 1 else None,
            "loss": float(m["loss"]), "xla_bytes": xla, "rss_timeline": timeline,
            "config": {k: str(getattr(config, k)) for k in (
                "scan_layers", "remat", "attention_backend", "dtype")},
            "memory_scheduler": memory_scheduler, "place_copy": place_copy}


def _jax_default(ckpt: str, n: int, steps: int) -> dict:
    """The RL step as a user writes it without knowing any preset: every default."""
    import logging

    import jax

    from ac2_jax.models import load_hf_checkpoint
    from ac2_jax.training import (
        OptimizerConfig,
        PolicyGradientLoss,
        create_train_state,
        make_train_step,
    )

    plan: list = []

    class Keep(logging.Handler):
        def emit(self, record):
            plan.append(record.getMessage())

    logger = logging.getLogger("ac2_jax.models.memory_plan")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    timeline: list = []
    _mark(timeline, "start")
    opt = OptimizerConfig(learning_rate=1e-6, weight_decay=0.1, clip_norm=1.0)
    t0 = time.perf_counter()
    model, config = load_hf_checkpoint(ckpt)
    load_s = time.perf_counter() - t0
    _mark(timeline, "load checkpoint")
    graphdef, state = create_train_state(model, opt)
    del model
    _mark(timeline, "create_train_state")
    batch, _, _ = _jax_problem("jax_rl", config, n, 0)
    step = make_train_step(graphdef, PolicyGradientLoss(), opt)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
        _mark(timeline, f"step {i + 1}")
    return {"load_s": load_s, "first_step_s": times[0], "step_s": times[-1] if steps > 1 else None,
            "loss": float(m["loss"]), "rss_timeline": timeline, "plan": plan,
            "config": {k: str(getattr(config, k)) for k in (
                "scan_layers", "remat", "attention_backend", "dtype")}}


def _scheduler_speed(ckpt: str, variant: str, n: int, chunk: int, steps: int,
                     layers: int) -> dict:
    """Step time of the RL step compiled with XLA:CPU's memory-optimized scheduler and
    with its default one, side by side in one process (alternating, same state, no
    donation), on the preset's shape cut to `layers` layers (random init: the ratio,
    not the model, is the point)."""
    import jax
    from flax import nnx

    from ac2_jax.models.decoder import Decoder
    from ac2_jax.models.io.hf_io import load_hf_config
    from ac2_jax.training import OptimizerConfig, create_train_state, make_train_step
    from experiments.real_size import qwen3
    from experiments.real_size.checkpoint import preset_runtime

    timeline: list = []
    _mark(timeline, "start")
    config = load_hf_config(ckpt, **preset_runtime(qwen3.get_config(variant)))
    config = config.replace(num_layers=layers or config.num_layers)
    batch, extras, loss = _jax_problem("jax_rl", config, n, chunk)
    opt = OptimizerConfig(learning_rate=1e-6, weight_decay=0.1, clip_norm=1.0)
    graphdef, state = create_train_state(Decoder(config, rngs=nnx.Rngs(0)), opt)
    steps_by = {on: make_train_step(graphdef, loss, opt, donate=False, cpu_memory_scheduler=on)
                for on in (True, False)}
    times: dict = {True: [], False: []}
    for i in range(steps + 1):  # the first round compiles
        for on, step in steps_by.items():
            t0 = time.perf_counter()
            jax.block_until_ready(step(state, batch, extras)[1])
            if i:
                times[on].append(time.perf_counter() - t0)
        _mark(timeline, f"round {i}")
    mem, default = min(times[True]), min(times[False])
    return {"layers": config.num_layers, "step_s": mem, "default_scheduler_step_s": default,
            "memory_over_default": mem / default, "rss_timeline": timeline}


def _torch_step(ckpt: str, n: int, steps: int) -> dict:
    import torch
    import transformers

    timeline: list = []
    _mark(timeline, "start")
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    load_s = time.perf_counter() - t0
    _mark(timeline, "load checkpoint")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.1)
    ids = torch.from_numpy(_tokens(n, model.config.vocab_size).astype("int64"))[None]
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        _mark(timeline, f"step {len(times)}")
    return {"load_s": load_s, "first_step_s": times[0], "step_s": times[-1] if steps > 1 else None,
            "loss": float(loss.detach()), "torch_threads": torch.get_num_threads(),
            "rss_timeline": timeline}


def _decode(ckpt: str, variant: str, batch: int, new_tokens: int) -> dict:
    import asyncio

    from ac2_jax.models import load_hf_checkpoint
    from ac2_jax.sampling import JaxSampler, SamplingParams
    from experiments.real_size import qwen3
    from experiments.real_size.checkpoint import preset_runtime

    timeline: list = []
    _mark(timeline, "start")
    # Per-layer weights: scanned decode slices every layer's weights and cache out of the
    # stacked arrays each step (~1.6x slower on CPU, docs/notes/2026-12-02-qwen3-06b-policy-on-2-cores.md), so a CPU sampler
    # keeps the per-layer layout.
    model, config = load_hf_checkpoint(ckpt, **{**preset_runtime(qwen3.get_config(variant)),
                                               "scan_layers": False})
    _mark(timeline, "load checkpoint")
    sampler = JaxSampler(model, max_batch=batch, max_context=1024, seed=0)
    params = SamplingParams(max_tokens=new_tokens, temperature=1.0)

    async def run():
        prompts = [_tokens(64, config.vocab_size, seed=i).tolist() for i in range(batch)]
        return await asyncio.gather(*(sampler.generate(p, params) for p in prompts))

    try:
        asyncio.run(run())  # compiles
        _mark(timeline, "first batch (compiles)")
        t0 = time.perf_counter()
        out = asyncio.run(run())
        wall = time.perf_counter() - t0
        _mark(timeline, "second batch")
    finally:
        sampler.close()
    toks = sum(len(r.output_ids) for r in out)
    return {"step_s": wall, "tokens_per_s": toks / wall, "output_tokens": toks,
            "batch": batch, "rss_timeline": timeline}


def child(args) -> dict:
    if args.case == "torch":
        out = _torch_step(args.ckpt, args.n, args.steps)
    elif args.case == "jax_sched":
        out = _scheduler_speed(args.ckpt, args.variant, args.n, args.chunk, args.steps,
                               args.sched_layers)
    elif args.case == "jax_default":
        out = _jax_default(args.ckpt, args.n, args.steps)
    elif args.case == "jax_decode":
        out = _decode(args.ckpt, args.variant, args.decode_batch, args.decode_tokens)
    else:
        out = _jax_step(args.case, args.ckpt, args.variant, args.n, args.chunk, args.steps,
                        bool(args.memory_scheduler), bool(args.place_copy))
    out["peak_rss_gb"] = peak_rss_bytes() / 1e9
    return out


def peak_rss_bytes() -> int:
    """This process's peak RSS: VmHWM (per address space, so reset by exec; ru_maxrss
    is not, and would report a larger parent's peak), else ru_maxrss."""
    return _status_kb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--variant", default="default", help="experiments/real_size/qwen3.py variant")
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--cases", default="jax_rl,jax_opsd,torch")
    p.add_argument("--chunk", type=int, default=512, help="log-prob chunk (0: dense logits)")
    p.add_argument("--decode_batch", type=int, default=8)
    p.add_argument("--decode_tokens", type=int, default=32)
    p.add_argument("--ckpt", default=None, help="an HF checkpoint dir (default: write one)")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--steps", type=int, default=2, help="train steps per case (the first compiles)")
    p.add_argument("--memory_scheduler", type=int, default=1,
                   help="1: XLA:CPU memory-optimized scheduler for the step (the default); 0: "
                        "XLA's default (for before/after figures)")
    p.add_argument("--sched_layers", type=int, default=4,
                   help="jax_sched: layers of the cut-down model (0: all)")
    p.add_argument("--place_copy", type=int, default=0,
                   help="1: step.place(state) copies the state (the caller's arrays stay "
                        "alive); 0: the step takes it over")
    p.add_argument("--child", default=None, help=argparse_hidden())
    p.add_argument("--case", default=None, help=argparse_hidden())
    p.add_argument("--n", type=int, default=0, help=argparse_hidden())
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return None
    from experiments.real_size import qwen3
    from experiments.real_size.checkpoint import write_random_checkpoint

    print(json.dumps({"machine": machine()}), flush=True)
    tmp = tempfile.TemporaryDirectory()
    ckpt = args.ckpt or write_random_checkpoint(qwen3.get_config(args.variant).shape,
                                                os.path.join(tmp.name, "ckpt"))
    rows = []
    for case in args.cases.split(","):
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}; choose from {CASES}")
        for n in ([0] if case == "jax_decode" else [int(x) for x in args.tokens.split(",")]):
            cmd = [sys.executable, "-m", "benchmarks.bench_real_size", "--child", "1",
                   "--case", case, "--n", str(n), "--ckpt", ckpt, "--variant", args.variant,
                   "--chunk", str(args.chunk), "--steps", str(args.steps),
                   "--decode_batch", str(args.decode_batch),
                   "--decode_tokens", str(args.decode_tokens),
                   "--memory_scheduler", str(args.memory_scheduler),
                   "--place_copy", str(args.place_copy), "--sched_layers", str(args.sched_layers)]
            row = {"case": case, "tokens": n or None}
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
                if r.returncode == 0 and line:
                    row.update(json.loads(line[-1][7:]))
                else:  # e.g. killed for memory (-9): recorded, not hidden
                    row["error"] = f"exit {r.returncode}: {(r.stderr or '')[-300:]}"
            except subprocess.TimeoutExpired:
                row["error"] = f"timeout after {args.timeout}s"
            rows.append(row)
            print(json.dumps(row), flush=True)
    print_table(rows, ["case", "tokens", "peak_rss_gb", "first_step_s", "step_s", "loss",
                       "tokens_per_s", "memory_over_default", "error"])
    write_json(args.out, {"benchmark": "real_size", "variant": args.variant,
                          "chunk": args.chunk, "rows": rows})
    tmp.cleanup()
    return rows


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
