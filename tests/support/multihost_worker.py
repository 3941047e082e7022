"""One process of a multi-host learner run (tests/training/core/test_distributed.py starts it).

    python tests/support/multihost_worker.py --out DIR --workdir W --steps 3 \
        [--process_id I --num_processes N --port P --local_devices 4]

Trains a tiny decoder for --steps steps with the Trainer on a ('data',) mesh
over every process's devices; each process packs only its share of the
segments. With --restore_steps K it first restores W's latest checkpoint and
trains K more steps. With --publish_dir D --publish_at K every process
publishes the weights after K steps to D (Orbax needs them all; the sampler
reads D). Process 0 writes DIR/result.npz: per-step losses and the final
params (gathered). With --rl_workdir R it then runs an RLTrainer for --rl_steps
steps over a ReplayCollector of fixed traces (main and compactor episodes,
rewards that differ within each group) on the same mesh: every process reads
all traces and packs its share; result.npz gains rl_losses and the RL params
(prefix r), and each process writes DIR/rl_metrics<process>.json (its history).
With --then_restore W2 (one process) a new Trainer over fresh weights then restores
W2's latest checkpoint and trains --then_steps more steps: result.npz gains
then_start, then_losses and its params (prefix q).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--restore", action="store_true")
    p.add_argument("--snapshot_at", type=int, default=0, help="also keep the params after k steps")
    p.add_argument("--publish_dir", default="")
    p.add_argument("--publish_at", type=int, default=0, help="publish after k steps")
    p.add_argument("--process_id", type=int, default=0)
    p.add_argument("--num_processes", type=int, default=1)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--local_devices", type=int, default=8)
    p.add_argument("--rl_workdir", default="", help="then an RLTrainer run in this workdir")
    p.add_argument("--rl_steps", type=int, default=2)
    p.add_argument("--then_restore", default="",
                   help="then (1 process) a new Trainer restores this workdir's latest "
                        "checkpoint and trains --then_steps more steps")
    p.add_argument("--then_steps", type=int, default=2)
    a = p.parse_args()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_num_cpu_devices", a.local_devices)
    from ac2_jax.training.core import distributed
    if a.num_processes > 1:
        distributed.initialize(f"127.0.0.1:{a.port}", a.num_processes, a.process_id)

    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.segments import pack_segments, task_names
    from ac2_jax.training import OptimizerConfig, SFTLoss, Trainer, create_train_state
    from ac2_jax.training.core.checkpoints import publish
    from ac2_jax.training.core.sharding import make_mesh
    from ac2_jax.training.rl import rl_segment

    assert jax.device_count() == 8, jax.devices()
    rng = np.random.default_rng(0)
    segs = []
    for i in range(12):  # 6 tasks, 2 segments each, 5-15 tokens
        n = int(rng.integers(5, 16))
        segs.append(rl_segment(rng.integers(0, 64, n), [0] * 2 + [1] * (n - 2), np.zeros(n),
                            task=f"task{i // 2}"))
    mesh = make_mesh(data=8)
    mine = distributed.process_share(segs)
    offset = sum(len(distributed.process_share(segs, j)) for j in range(jax.process_index()))
    rows = 8 // jax.process_count()
    batch = pack_segments(mine, 32, all_tasks=task_names(segs), segment_offset=offset,
                          min_rows=rows, rows_multiple=rows, min_tasks=8, min_segments=16)
    opt = OptimizerConfig(learning_rate=1e-2, warmup_steps=0)
    graphdef, state = create_train_state(Decoder(DecoderConfig.tiny(vocab_size=64, num_layers=2),
                                                 rngs=nnx.Rngs(0)), opt)
    trainer = Trainer(graphdef, state, SFTLoss(mode="task_mean"), opt, workdir=a.workdir,
                      mesh=mesh, tensorboard=False)
    start = trainer.restore() if a.restore else 0
    def gathered(prefix, trainer=trainer):
        params = jax.tree.leaves(trainer.host_state().params)
        return {f"{prefix}{i}": np.asarray(multihost_utils.process_allgather(x, tiled=True))
                for i, x in enumerate(params)}

    losses, snapshot = [], {}
    for k in range(a.steps):
        m = trainer.update(batch)
        trainer.end_step(m)
        losses.append(m["loss"])
        if k + 1 == a.snapshot_at:
            snapshot = gathered("s")
        if k + 1 == a.publish_at:  # every process calls it: Orbax writes each one's shards
            publish(trainer.graphdef, trainer.host_state(), a.publish_dir, start + k + 1)
    trainer.save()
    trainer.wait()
    final = gathered("p")
    trainer.close()
    rl = run_rl(a, mesh) if a.rl_workdir else {}
    then = {}
    if a.then_restore:  # a new Trainer, fresh weights, restored from another run's workdir
        assert jax.process_count() == 1, "--then_restore is a 1-process continuation"
        _, fresh = create_train_state(Decoder(DecoderConfig.tiny(vocab_size=64, num_layers=2),
                                              rngs=nnx.Rngs(5)), opt)
        again = Trainer(graphdef, fresh, SFTLoss(mode="task_mean"), opt,
                        workdir=a.then_restore, mesh=mesh, tensorboard=False)
        then["then_start"] = again.restore()
        then_losses = []
        for _ in range(a.then_steps):
            m = again.update(batch)
            again.end_step(m)
            then_losses.append(m["loss"])
        then["then_losses"] = np.asarray(then_losses)
        then.update(gathered("q", again))
        again.close()
    if jax.process_index() == 0:
        np.savez(os.path.join(a.out, "result.npz"), losses=np.asarray(losses), start=start,
                 **final, **snapshot, **rl, **then)


def rl_traces(steps: int):
    """2 tasks x 4 attempts per RL step; each attempt a main episode (two requests), a
    compactor episode and the main's restart, sampled at the step's version (not
    stale); rewards alternate within each group, so every advantage is +-0.5."""
    import numpy as np

    from ac2_jax.trace import Completion, Trace, TraceRecorder
    rng = np.random.default_rng(1)
    out = []
    for step in range(steps):
        for task in range(2):
            for att in range(4):
                t = Trace(task_id=f"task{task}", attempt_id=f"{step}-{att}",
                          group_id=f"g{step}:{task}", reward=float((att + task) % 2),
                          status="finished", metadata={"rl_step": step})
                rec = TraceRecorder(t)
                for agent in ("main", "compactor", "main"):
                    prompt = rng.integers(1, 64, 4).tolist()
                    n = int(rng.integers(2, 6))
                    rec.record(agent, Completion(prompt, rng.integers(1, 64, n).tolist(),
                                                 (-rng.random(n)).tolist(), policy_version=step))
                out.append(t)
    return out


def run_rl(a, mesh) -> dict:
    import asyncio
    import json

    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.training import OptimizerConfig
    from ac2_jax.training.rl.data import BatchConfig
    from ac2_jax.training.rl.trainer import ReplayCollector, RLConfig, RLTrainer
    config = RLConfig(steps=a.rl_steps, tasks_per_step=2, attempts_per_task=4,
                      batch=BatchConfig(seq_len=32, rows=8, rows_multiple=8),
                      optimizer=OptimizerConfig(learning_rate=1e-2, warmup_steps=0))
    trainer = RLTrainer(Decoder(DecoderConfig.tiny(vocab_size=64, num_layers=2),
                                rngs=nnx.Rngs(1)), ReplayCollector(rl_traces(a.rl_steps)),
                        config, a.rl_workdir, mesh=mesh)
    history = asyncio.run(trainer.run())
    params = jax.tree.leaves(trainer.trainer.host_state().params)
    out = {f"r{i}": np.asarray(multihost_utils.process_allgather(x, tiled=True))
           for i, x in enumerate(params)}
    trainer.close()
    with open(os.path.join(a.out, f"rl_metrics{jax.process_index()}.json"), "w") as f:
        json.dump(history, f, default=str)
    return {"rl_losses": np.asarray([m["loss"] for m in history]), **out}


if __name__ == "__main__":
    main()
