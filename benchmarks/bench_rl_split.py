"""RL steps/hour of the toy RL job: one process vs the split driver (endpoint,
collector and learner as three processes), sync and async.

    python -m benchmarks.bench_rl_split --steps=6 --out=rl_split.json

The config is experiments/configs/rl_split.py:toy (a random tiny model, the
length-parity env, 2 tasks x 4 attempts per step) with `--steps` RL steps.
`inproc` is the one-process driver (experiments/calculator_agent.py's
wiring: the endpoint in a thread over `load_policy`'s JaxSampler, an
EndpointCollector, RLTrainer publishing in-process); `split_sync` and
`split_async` run `python -m ac2_jax.serving` + `python -m experiments.rl_split
--role=collect` + `--role=learn` (rl.mode sync: the collector waits for each
update; async: it runs one step ahead). The sampler has fixed shapes (all
compiled at start, so no step pays a sampler compile; --bucketed_shapes for
the default) in both. steps/hour = 3600 / the mean
`time_step_s` of the learner's steps after the first (the first compiles);
wall_s is the whole run, process start-up included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

from benchmarks.common import write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "experiments/configs/rl_split.py:toy"
FIXED_SHAPES = True  # --bucketed_shapes: the sampler compiles new shapes as traffic varies


def _summary(name: str, history: list[dict], wall_s: float) -> dict:
    steady = [h["time_step_s"] for h in history[1:]]
    mean = statistics.mean(steady) if steady else None
    return {"driver": name, "steps": len(history), "wall_s": wall_s,
            "time_step_s": [round(h["time_step_s"], 3) for h in history],
            "time_sampling_s": [round(h["time_sampling_s"], 3) for h in history],
            "time_training_s": [round(h["time_training_s"], 3) for h in history],
            "staleness_max": [h.get("staleness_max") for h in history],
            "steps_per_hour": 3600 / mean if mean else None,
            "load_avg_after": os.getloadavg()}


async def inproc(cfg, policy: str) -> dict:
    from ac2_jax.orchestration import LifecycleClient
    from ac2_jax.serving.app import build_app
    from ac2_jax.serving.server import load_policy, serve_in_thread
    from ac2_jax.trace import TraceStore
    from ac2_jax.training.rl.collectors import EndpointCollector
    from ac2_jax.training.rl.trainer import RLTrainer
    from ac2_jax.models.hf_io import load_hf_checkpoint
    from experiments import calculator_agent as demo
    from experiments.rl_split import build_env

    t0 = time.perf_counter()
    rl, ro = demo.typed_configs(cfg)["rl"], cfg.rollout
    rl_dir = os.path.join(cfg.workdir, "rl")
    sampler, tokenizer, name = load_policy(policy, max_context=128, max_batch=8,
                                           publish_dir=os.path.join(rl_dir, "published"),
                                           fixed_shapes=FIXED_SHAPES)
    key = secrets.token_hex(8)
    url, stop = serve_in_thread(build_app(sampler, tokenizer, admin_key=key, model_name=name))
    lifecycle = LifecycleClient(url, key)
    try:
        collector = EndpointCollector(
            lifecycle, build_env(cfg), demo.orchestrator_factory(
                {"temperature": ro.temperature, "max_tokens": ro.max_tokens}, ro.max_steps),
            name, TraceStore(os.path.join(rl_dir, "rollouts.jsonl")),
            tasks_per_step=rl.tasks_per_step, attempts_per_task=rl.attempts_per_task,
            seed=demo.rl_collector_seed(cfg), concurrency=rl.concurrency,
            infra_retries=ro.infra_retries)
        trainer = RLTrainer(load_hf_checkpoint(policy)[0], collector, rl, rl_dir,
                            on_publish=sampler.load_weights)
        history = await trainer.run()
        trainer.close()
    finally:
        await lifecycle.aclose()
        stop()
        sampler.close()
    return _summary("inproc", history, time.perf_counter() - t0)


def split(cfg, policy: str, mode: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url, key, w = f"http://127.0.0.1:{port}", secrets.token_hex(8), cfg.workdir
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")])))
    over = [f"--config={CONFIG}", f"--config.workdir={w}", f"--config.rl.steps={cfg.rl.steps}",
            f"--config.rl.mode={mode}", f"--admin_key={key}", f"--endpoint={url}"]
    cmds = [["ac2_jax.serving", f"--model={policy}", f"--publish_dir={w}/rl/published",
             f"--admin_key={key}", f"--port={port}", "--max_batch=8", "--max_context=128",
             f"--fixed_shapes={FIXED_SHAPES}"],
            ["experiments.rl_split", "--role=collect", *over],
            ["experiments.rl_split", "--role=learn", *over]]
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-m", *c], cwd=ROOT, env=env,
                              stdout=open(os.path.join(w, f"{c[0]}.{i}.log"), "w"),
                              stderr=subprocess.STDOUT) for i, c in enumerate(cmds)]
    try:
        for p in procs[:0:-1]:  # learner, then collector
            if p.wait(timeout=1800) != 0:
                raise RuntimeError(f"{p.args[2:4]} failed; logs in {w}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=60)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in open(os.path.join(w, "rl", "metrics", "metrics.jsonl"))]
    history = [{k[len("train/"):]: v for k, v in r.items() if k.startswith("train/")}
               for r in rows]
    return _summary(f"split_{mode}", history, wall)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--drivers", default="inproc,split_sync,split_async")
    p.add_argument("--workdir", default="runs/bench_rl_split")
    p.add_argument("--out", default=None)
    p.add_argument("--bucketed_shapes", action="store_true",
                   help="the sampler's default bucketed shapes (compiles while serving) "
                        "instead of --fixed_shapes (all compiled at start)")
    a = p.parse_args(argv)
    global FIXED_SHAPES
    FIXED_SHAPES = not a.bucketed_shapes
    from experiments import rl_split
    from experiments.configs.rl_split import get_config

    report = {"cpu_count": os.cpu_count(), "load_avg_before": os.getloadavg(), "runs": []}
    base = os.path.abspath(a.workdir)
    for driver in a.drivers.split(","):
        cfg = get_config("toy")
        cfg.rl.steps = a.steps
        cfg.workdir = os.path.join(base, driver)
        shutil.rmtree(cfg.workdir, ignore_errors=True)
        policy = rl_split.prepare(cfg, log=lambda _: None)
        if driver == "inproc":
            run = asyncio.run(inproc(cfg, policy))
        elif driver.startswith("split_"):
            run = split(cfg, policy, driver[len("split_"):])
        else:
            raise ValueError(f"--drivers: unknown {driver!r} (inproc, split_sync, split_async)")
        report["runs"].append(run)
        print(json.dumps({k: run[k] for k in ("driver", "steps_per_hour", "wall_s",
                                              "time_step_s", "load_avg_after")}), flush=True)
    write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()
