"""The RL job as separate processes: endpoint, collector and learner (docs/launch.md).

    C=experiments/rl_split/config.py:toy; W=runs/split
    python -m experiments.rl_split --role=prepare --config=$C --config.workdir=$W
    python -m ac2_jax.serving --model=$W/policy --publish_dir=$W/rl/published \
        --admin_key=$KEY --port=8000 --max_batch=64 &
    python -m experiments.rl_split --role=collect --config=$C --config.workdir=$W \
        --admin_key=$KEY &
    python -m experiments.rl_split --role=learn --config=$C --config.workdir=$W --admin_key=$KEY

A learner spanning hosts runs `--role=learn` once per host with --distributed
(jax.distributed auto-detects TPU slices, SLURM, Kubernetes) or
--coordinator_address=HOST:PORT --num_processes=N --process_id=I; every process
reads the same store, packs its share of each batch, checkpoints and publishes
(Orbax needs them all); process 0 tells the endpoint. Shares need
--config.rl.batch.layout=flat.

prepare: the tokenizer and the starting policy (the calculator demo's SFT warm
start, or a random tiny model for the toy env) as one HF directory,
`workdir/policy`, that the endpoint serves and the learner starts from.
collect: rollouts of every RL step through the endpoint into
`workdir/rl/rollouts.jsonl`, each step marked complete in
`workdir/rl/rollouts.steps/` (`ac2_jax.training.rl.split.run_collector`).
learn: `RLTrainer` over those traces; checkpoints in `workdir/rl/checkpoints`,
weights published to `workdir/rl/published` (the endpoint's --publish_dir),
then the endpoint is told to load them. The collector runs ahead of the learner by
at most `rl.batch.max_staleness` steps in `rl.mode="async"`, none in "sync".
Either process resumes where it stopped when started again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from absl import app, flags
from absl import logging as absl_logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from experiments.rl_split.toy_envs import AlternatingEnv, LengthParityEnv  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/rl_split/config.py")
flags.DEFINE_enum("role", None, ["prepare", "collect", "learn"], "Which process this is.")
flags.DEFINE_string("endpoint", None, "The endpoint's base URL (default: config split.endpoint).")
flags.DEFINE_string("admin_key", None, "The endpoint's admin key (or env AC2_ADMIN_KEY).")
flags.DEFINE_bool("distributed", False, "learn: start jax.distributed with auto-detection "
                  "(TPU slice, SLURM, Kubernetes) and train on a mesh over every process.")
flags.DEFINE_string("coordinator_address", None, "learn: jax.distributed coordinator host:port "
                    "(process 0's); with --num_processes and --process_id.")
flags.DEFINE_integer("num_processes", None, "learn: processes of the multi-host learner.")
flags.DEFINE_integer("process_id", None, "learn: this process's index in [0, num_processes).")
FLAGS = flags.FLAGS
# env.kind -> the toy envs (a random tiny model, the tiny tokenizer): "parity" rewards
# the answer's length parity (the toy variant), "alternating" the k-th check of a task
# k % 2 (no group ties, so every step updates: tests/training/rl/test_split.py).
TOY_ENVS = {"parity": LengthParityEnv, "alternating": AlternatingEnv}


def _paths(cfg) -> dict[str, str]:
    w = os.path.abspath(cfg.workdir)
    return {"policy": os.path.join(w, "policy"), "rl": os.path.join(w, "rl"),
            "store": os.path.join(w, "rl", "rollouts.jsonl")}


def build_env(cfg):
    from experiments.calculator import agent as calculator_agent
    if cfg.env.kind in TOY_ENVS:
        return TOY_ENVS[cfg.env.kind]()
    if cfg.env.kind == "calculator":
        return calculator_agent.build_env(cfg)
    raise ValueError(f"env.kind must be 'calculator', {' or '.join(map(repr, TOY_ENVS))}, "
                     f"got {cfg.env.kind!r}")


def prepare(cfg, log=print) -> str:
    """Writes the starting policy + tokenizer to workdir/policy; returns the path."""
    from ac2_jax.models.io.hf_io import save_hf_checkpoint
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
    from experiments.calculator import agent as calculator_agent
    paths = _paths(cfg)
    env = build_env(cfg)
    tok_dir = os.path.join(os.path.abspath(cfg.workdir), "tokenizer")
    if cfg.env.kind in TOY_ENVS:
        tokenizer = build_tiny_tokenizer(tok_dir)
        model = calculator_agent.build_model(cfg, tokenizer.vocab_size)
    else:
        tokenizer = calculator_agent.build_tokenizer(cfg, tok_dir, env)
        model = calculator_agent.build_model(cfg, tokenizer.vocab_size)
        model, _ = calculator_agent.sft_warm_start(cfg, model, tokenizer, env, log)
    save_hf_checkpoint(model, paths["policy"])
    tokenizer.save_pretrained(paths["policy"])
    log(f"policy: {paths['policy']}")
    return paths["policy"]


def _lifecycle(cfg):
    from ac2_jax.orchestration import LifecycleClient
    key = FLAGS.admin_key or os.environ.get("AC2_ADMIN_KEY")
    if not key:
        raise ValueError("--admin_key (or env AC2_ADMIN_KEY) is required: the endpoint's admin key")
    return LifecycleClient(FLAGS.endpoint or cfg.split.endpoint, key)


def alarms_config(cfg):
    """The processes' `AlarmsConfig` from the config's `alarms` section (defaults: on)."""
    from ac2_jax.training.rl.alarms import AlarmConfig, AlarmsConfig
    a = cfg.get("alarms")
    if a is None:
        return AlarmsConfig()
    return AlarmsConfig(enabled=a.enabled,
                        hang=AlarmConfig(threshold=a.hang_s, action=a.hang_action),
                        drift=AlarmConfig(threshold=a.drift, action=a.drift_action))


def _lead(rl) -> int:
    """Steps the collector may run ahead: the in-process loop's overlap."""
    return rl.batch.max_staleness if rl.mode == "async" else 0


async def collect(cfg, log=print) -> list[int]:
    from ac2_jax.trace import TraceStore
    from ac2_jax.training.rl.collectors import EndpointCollector
    from ac2_jax.training.rl.split import StepMarkers, run_collector, wait_for_endpoint
    from experiments.calculator import agent as calculator_agent
    rl, ro = calculator_agent.typed_configs(cfg)["rl"], cfg.rollout
    lifecycle = _lifecycle(cfg)
    try:
        model_name = (await wait_for_endpoint(lifecycle, poll_s=cfg.split.poll_s,
                                              timeout_s=cfg.split.wait_timeout_s))["id"]
        store = TraceStore(_paths(cfg)["store"])
        collector = EndpointCollector(
            lifecycle, build_env(cfg), calculator_agent.orchestrator_factory(
                {"temperature": ro.temperature, "max_tokens": ro.max_tokens}, ro.max_steps),
            model_name, store, tasks_per_step=rl.tasks_per_step,
            attempts_per_task=rl.attempts_per_task, seed=calculator_agent.rl_collector_seed(cfg),
            concurrency=rl.concurrency, infra_retries=ro.infra_retries)
        return await run_collector(collector, lifecycle, StepMarkers.of(store), steps=rl.steps,
                                   max_staleness=_lead(rl), poll_s=cfg.split.poll_s,
                                   timeout_s=cfg.split.wait_timeout_s, log=log,
                                   alarms=alarms_config(cfg))
    finally:
        await lifecycle.aclose()


def start_distributed() -> None:
    """jax.distributed for a learner spanning processes (before any computation):
    explicit with --coordinator_address / --num_processes / --process_id,
    auto-detected with --distributed; neither: one process."""
    from ac2_jax.training.core import distributed
    explicit = (FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
    if any(v is not None for v in explicit):
        if any(v is None for v in explicit):
            raise app.UsageError("--coordinator_address, --num_processes and --process_id go "
                                 "together (or pass --distributed to auto-detect them)")
        distributed.initialize(*explicit)
    elif FLAGS.distributed:
        distributed.initialize()


async def learn(cfg, log=print) -> list[dict]:
    import jax

    from ac2_jax.models.io.hf_io import load_hf_checkpoint
    from ac2_jax.trace import TraceStore
    from ac2_jax.training.rl.split import StepMarkers, StoreCollector, run_learner, tell_endpoint
    from ac2_jax.training.rl.trainer import RLTrainer
    from experiments.calculator import agent as calculator_agent
    rl = calculator_agent.typed_configs(cfg)["rl"]
    if rl.dynamic_sampling:
        raise ValueError("rl.dynamic_sampling needs refills from the collector mid-step; the "
                         "split driver has none (use experiments/calculator/train.py)")
    paths = _paths(cfg)
    model, _ = load_hf_checkpoint(paths["policy"])
    store = TraceStore(paths["store"])
    collector = StoreCollector(store, StepMarkers.of(store), tasks_per_step=rl.tasks_per_step,
                               attempts_per_task=rl.attempts_per_task,
                               max_staleness=rl.batch.max_staleness, poll_s=cfg.split.poll_s,
                               timeout_s=cfg.split.wait_timeout_s)
    lifecycle = _lifecycle(cfg)
    mesh = None
    if jax.process_count() > 1:  # a multi-host learner: every process packs its share
        from ac2_jax.training.core.sharding import make_mesh
        mesh = make_mesh(data=jax.device_count())

    async def silent(steps_done, version):  # one process tells the endpoint
        return None

    trainer = RLTrainer(model, collector, rl, paths["rl"], mesh=mesh,
                        on_progress=tell_endpoint(lifecycle) if jax.process_index() == 0
                        else silent, alarms=alarms_config(cfg))
    try:
        return await run_learner(trainer, lifecycle, poll_s=cfg.split.poll_s,
                                 timeout_s=cfg.split.wait_timeout_s, log=log)
    finally:
        trainer.close()
        await lifecycle.aclose()


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)   # Orbax logs every save at INFO
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cfg = _CONFIG.value
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    if FLAGS.role == "prepare":
        prepare(cfg, log)
    elif FLAGS.role == "collect":
        asyncio.run(collect(cfg, log))
    elif FLAGS.role == "learn":
        start_distributed()
        asyncio.run(learn(cfg, log))
    else:
        raise app.UsageError("--role=prepare|collect|learn is required")


if __name__ == "__main__":
    app.run(main)
