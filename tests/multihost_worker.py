"""One process of a multi-host learner run (tests/test_distributed.py starts it).

    python tests/multihost_worker.py --out DIR --workdir W --steps 3 \
        [--process_id I --num_processes N --port P --local_devices 4]

Trains a tiny decoder for --steps steps with the Trainer on a ('data',) mesh
over every process's devices; each process packs only its share of the
segments. With --restore_steps K it first restores W's latest checkpoint and
trains K more steps. With --publish_dir D --publish_at K every process
publishes the weights after K steps to D (Orbax needs them all; the sampler
reads D). Process 0 writes DIR/result.npz: per-step losses and the final
params (gathered).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    from ac2_jax.segments import Segment, pack_segments, task_names
    from ac2_jax.training import OptimizerConfig, SFTLoss, Trainer, create_train_state
    from ac2_jax.training.core.checkpoints import publish
    from ac2_jax.training.core.sharding import make_mesh

    assert jax.device_count() == 8, jax.devices()
    rng = np.random.default_rng(0)
    segs = []
    for i in range(12):  # 6 tasks, 2 segments each, 5-15 tokens
        n = int(rng.integers(5, 16))
        segs.append(Segment(rng.integers(0, 64, n), [0] * 2 + [1] * (n - 2), np.zeros(n),
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
    def gathered(prefix):
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
    if jax.process_index() == 0:
        np.savez(os.path.join(a.out, "result.npz"), losses=np.asarray(losses), start=start,
                 **final, **snapshot)


if __name__ == "__main__":
    main()
