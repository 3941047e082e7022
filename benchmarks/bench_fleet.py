"""RL steps/hour of the calculator demo: its embedded sampler vs 1 or 2 sampler
backend processes behind the endpoint (a FleetSampler).

    python -m benchmarks.bench_fleet --backends=0,1,2 --steps=4 --out=fleet.json

The demo's config (experiments/configs/calculator.py; `--sft_steps` may
shorten its warm start). The SFT warm start runs once (kept in --workdir) and
is written as an HF directory; `0` is the demo's own setup (a JaxSampler in
the endpoint's process), `n > 0` starts n `python -m ac2_jax.serving.backend
--model=DIR` processes and fronts them with `load_policy(backends=...)`.
Each setting then runs `--steps` RL steps from the same SFT weights, the
learner publishing after each update (every backend reloads it), and
steps/hour = 3600 / the mean `time_step_s` of the steps after the first (the
first compiles the train step and the sampler shapes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import statistics
import time

from ac2_jax.models import Tokenizer, load_hf_checkpoint, save_hf_checkpoint
from ac2_jax.models.params_io import restore_params, save_params
from ac2_jax.orchestration import LifecycleClient
from ac2_jax.sampling import JaxSampler
from ac2_jax.serving.app import build_app
from ac2_jax.serving.server import load_policy, serve_in_thread
from ac2_jax.trace import TraceStore
from ac2_jax.training.rl.trainer import EndpointCollector, RLTrainer
from benchmarks.common import write_json
from benchmarks.endpoint_harness import BackendProcess
from experiments import calculator_agent as demo
from experiments.configs.calculator import get_config

MODEL_NAME = demo.MODEL_NAME


def sft_weights(cfg, workdir: str) -> str:
    """The SFT warm start as an HF directory (tokenizer included); made once."""
    hf_dir = os.path.join(workdir, "sft_hf")
    if os.path.exists(os.path.join(hf_dir, "config.json")):
        return hf_dir
    env = demo.build_env(cfg)
    tokenizer = demo.build_tokenizer(cfg, os.path.join(workdir, "tokenizer"), env)
    model = demo.build_model(cfg, tokenizer.vocab_size)
    params = os.path.join(workdir, "sft_params")
    if os.path.exists(params):
        restore_params(model, params)
    else:
        model, _ = demo.sft_warm_start(cfg, model, tokenizer, env)
        save_params(model, params)
    save_hf_checkpoint(model, hf_dir)
    tokenizer.save_pretrained(hf_dir)
    return hf_dir


async def rl_steps(cfg, hf_dir: str, n_backends: int, workdir: str) -> dict:
    """`cfg.rl.steps` RL steps with the sampler embedded (0) or n backend processes."""
    rl = demo.typed_configs(cfg)["rl"]
    ro = cfg.rollout
    rl_dir = os.path.join(workdir, f"rl_{n_backends}")
    shutil.rmtree(rl_dir, ignore_errors=True)
    os.makedirs(rl_dir)
    publish_dir = os.path.join(rl_dir, "published")
    env = demo.build_env(cfg)
    tokenizer = Tokenizer.from_pretrained(hf_dir)
    model, _ = load_hf_checkpoint(hf_dir)
    context = cfg.model.max_position_embeddings
    procs = []
    t0 = time.perf_counter()
    if n_backends == 0:
        eos = [i for i in (tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None]
        sampler = JaxSampler(model, publish_dir=publish_dir, max_context=context,
                             max_batch=rl.concurrency, eos_token_ids=eos, tokenizer=tokenizer,
                             seed=cfg.seed)
    else:
        procs = [BackendProcess(os.path.join(rl_dir, f"backend{i}.log"), model=hf_dir,
                                env={"XLA_FLAGS": ""},
                                flags=[f"--max_context={context}", f"--max_batch={rl.concurrency}",
                                       f"--seed={cfg.seed + i}"])
                 for i in range(n_backends)]
        for p in procs:
            p.launch()
        urls = [p.wait_ready(timeout_s=300) for p in procs]
        sampler, _, _ = load_policy(hf_dir, backends=urls, max_context=context,
                                    publish_dir=publish_dir,
                                    export_dir=os.path.join(rl_dir, "export"))
    startup_s = time.perf_counter() - t0
    admin_key = secrets.token_hex(16)
    base_url, stop = serve_in_thread(build_app(sampler, tokenizer, admin_key=admin_key,
                                               model_name=MODEL_NAME))
    lifecycle = LifecycleClient(base_url, admin_key)
    try:
        collector = EndpointCollector(
            lifecycle, env, demo.orchestrator_factory(
                {"temperature": ro.temperature, "max_tokens": ro.max_tokens}, ro.max_steps),
            MODEL_NAME, TraceStore(os.path.join(rl_dir, "rollouts.jsonl")),
            tasks_per_step=rl.tasks_per_step, attempts_per_task=rl.attempts_per_task,
            seed=demo.rl_collector_seed(cfg), concurrency=rl.concurrency,
            infra_retries=ro.infra_retries)
        trainer = RLTrainer(model, collector, rl, rl_dir, on_publish=sampler.load_weights)
        history = await trainer.run()
        trainer.close()
        status = sampler.status() if hasattr(sampler, "status") else None
    finally:
        try:
            await lifecycle.aclose()
            stop()
            if n_backends == 0:
                sampler.close()
            else:
                await sampler.aclose()
        finally:  # the backend processes go whatever happened above
            for p in procs:
                p.kill()
    steady = [h["time_step_s"] for h in history[1:]]
    mean = statistics.mean(steady) if steady else None
    return {
        "backends": n_backends, "steps": len(history), "startup_s": startup_s,
        "time_step_s": [h["time_step_s"] for h in history],
        "time_sampling_s": [h["time_sampling_s"] for h in history],
        "time_training_s": [h["time_training_s"] for h in history],
        "time_publishing_s": [h["time_publishing_s"] for h in history],
        "reward_mean": [h["reward_mean"] for h in history],
        "infra_errors": [h.get("infra_errors") for h in history],
        "steps_per_hour": 3600 / mean if mean else None,
        "backend_requests": ([b["requests"] for b in status["backends"]] if status else None),
        "backend_errors": ([b["errors"] for b in status["backends"]] if status else None),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="0,1,2",
                   help="settings to run: 0 = embedded sampler, n = n backend processes")
    p.add_argument("--steps", type=int, default=4, help="RL steps per setting")
    p.add_argument("--sft_steps", type=int, default=None, help="default: the demo's")
    p.add_argument("--workdir", default="runs/bench_fleet")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cfg = get_config()
    cfg.rl.steps = a.steps
    if a.sft_steps is not None:
        cfg.sft.steps = a.sft_steps
    workdir = os.path.abspath(a.workdir)
    os.makedirs(workdir, exist_ok=True)
    t0 = time.perf_counter()
    hf_dir = sft_weights(cfg, workdir)
    report = {"sft_s": time.perf_counter() - t0, "cpu_count": os.cpu_count(),
              "load_avg_before": os.getloadavg(), "runs": []}
    for n in (int(x) for x in a.backends.split(",")):
        run = asyncio.run(rl_steps(cfg, hf_dir, n, workdir))
        run["load_avg_after"] = os.getloadavg()
        report["runs"].append(run)
        print(json.dumps({k: run[k] for k in ("backends", "steps_per_hour", "time_step_s",
                                              "backend_requests")}), flush=True)
    write_json(a.out, report)
    return report


if __name__ == "__main__":
    main()
