"""Where the calculator demo's RL sampling time goes: per RL step, the collection
wall time against what the sampler did (decode / prefill seconds, mean active
rows, new compiles), from the `sampler/...` metrics RLTrainer logs.

    python -m benchmarks.bench_rl_sampling --workdir runs/calculator --steps 6
    python -m benchmarks.bench_rl_sampling --workdir runs/calculator --steps 6 --no_warmup

It reuses the SFT warm start in `--workdir/sft_params` (the demo's; one is
trained and saved there first when absent) and, in a scratch directory, runs
`--steps` RL steps of experiments/configs/calculator.py (the demo's RL
config) through the real endpoint. `--no_warmup`: the sampler buckets its
cache length (no warmup), as the demo did before. `idle_s` = sampling wall
time - decode_s - prefill_s: the sampler waiting for requests (client-side
HTTP, orchestration, env). The first step's figures include first-use costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile

from benchmarks.common import print_table, write_json

COLS = ["step", "sampling_s", "decode_s", "prefill_s", "idle_s", "mean_active_rows",
        "decode_steps", "output_tokens", "new_shapes", "training_s"]


def run(workdir: str, steps: int, warmup: bool, variant: str | None = None) -> list[dict]:
    from experiments import calculator_agent as ca
    from experiments.configs.calculator import get_config

    cfg = get_config(variant)
    cfg.workdir = os.path.abspath(workdir)
    cfg.rl.steps = steps
    cfg.sampler.warmup = warmup
    env, tokenizer, model, _, _ = ca.prepare(cfg, cfg.workdir, log=lambda *a: None)
    run_dir = tempfile.mkdtemp(prefix="bench_rl_sampling_")
    rl_config = ca.typed_configs(cfg)["rl"]

    async def go():
        async with ca.serving(cfg, model, tokenizer, os.path.join(run_dir, "rl", "published"),
                              rl_config.concurrency,
                              os.path.join(run_dir, "served.jsonl")) as (sampler, lc):
            await ca.train_rl(cfg, rl_config, model, sampler, lc, env,
                              os.path.join(run_dir, "rl"), os.path.join(run_dir, "metrics"))

    try:
        asyncio.run(go())
        rows = []
        for line in open(os.path.join(run_dir, "metrics", "metrics.jsonl")):
            m = json.loads(line)
            s = {k.split("/")[-1]: v for k, v in m.items() if k.startswith("train/sampler/")}
            rows.append({"step": m["step"], "sampling_s": m["train/time_sampling_s"],
                         "training_s": m["train/time_training_s"],
                         "idle_s": m["train/time_sampling_s"] - s["decode_s"] - s["prefill_s"],
                         **{k: s[k] for k in ("decode_s", "prefill_s", "mean_active_rows",
                                              "decode_steps", "output_tokens", "new_shapes")}})
        return rows
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="runs/calculator")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--no_warmup", action="store_true")
    p.add_argument("--variant", default=None, help="a calculator.py variant (e.g. quick)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    rows = run(args.workdir, args.steps, not args.no_warmup, args.variant)
    print_table(rows, COLS)
    later = rows[1:] or rows
    summary = {k: statistics.mean(r[k] for r in later)
               for k in ("sampling_s", "decode_s", "prefill_s", "idle_s", "mean_active_rows")}
    print("mean of steps after the first:", {k: round(v, 3) for k, v in summary.items()})
    write_json(args.out, {"benchmark": "rl_sampling", "warmup": not args.no_warmup,
                          "rows": rows, "mean_after_first": summary})
    return rows


if __name__ == "__main__":
    main()
