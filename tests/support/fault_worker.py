"""A split-RL role process for the fault harness (tests/support/fault_harness.py).

    python tests/support/fault_worker.py --role=collect|learn ...  (experiments.rl_split's flags)
    python tests/support/fault_worker.py replay WORKDIR OUT.json   (the fault-free learner)

collect / learn run `experiments.rl_split` unchanged, after two test-only shims
read from the environment (never set in production):

  AC2_FAULT_JOURNAL=PATH  every rollout the collector creates at the endpoint is
      journaled (one O_APPEND line: rollout_id, rl_step, task, attempt, pid), and
      every run's end (status); the harness accounts for each started rollout.
  AC2_FAULT_QUOTA=BYTES:DIR  a full disk: writes through the trace store's and the
      step markers' `open` fail with OSError(ENOSPC) once the files under DIR
      would exceed BYTES (the write that crosses it is cut there, as a real
      disk cuts it).

replay: an RLTrainer over the stored, marked steps of WORKDIR (the same
batches the faulted learner trained), from the same starting policy, in a
fresh directory, with no faults; writes the max |difference| of its final
params to the faulted learner's latest published ones.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def _install_journal(path: str) -> None:
    from ac2_jax.orchestration.rollouts import LifecycleClient
    from ac2_jax.training.rl.collectors import EndpointCollector

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def note(**rec):  # one write() of one short line: a SIGKILL cannot tear it
        os.write(fd, (json.dumps({**rec, "pid": os.getpid()}) + "\n").encode())

    create, run = LifecycleClient.create, EndpointCollector._run
    # The endpoint's id of the run in progress (an attempt's task: its create and its
    # end share the context): a run that ends in an exception after its create returns
    # an infra_error trace without the id, and its end must still name the rollout.
    current = contextvars.ContextVar("fault_rollout", default=None)

    async def journaled_create(self, task_id, group_id=None, metadata=None, timeout_s=None,
                               **kw):
        info = await create(self, task_id, group_id, metadata, timeout_s, **kw)
        md = metadata or {}
        current.set(info["rollout_id"])
        note(event="start", rollout_id=info["rollout_id"], task=task_id,
             rl_step=md.get("rl_step"), attempt=md.get("attempt"))
        return info

    async def journaled_run(self, task, attempt, rl_step):
        current.set(None)
        trace = await run(self, task, attempt, rl_step)
        note(event="end", rollout_id=trace.metadata.get("rollout_id") or current.get(),
             task=task.task_id,
             rl_step=rl_step, attempt=attempt, status=trace.status)
        return trace

    LifecycleClient.create = journaled_create
    EndpointCollector._run = journaled_run


def _install_quota(spec: str) -> None:
    from ac2_jax.trace import store
    from ac2_jax.training.rl import split
    from tests.support.fault_procs import quota_open

    quota, directory = spec.split(":", 1)
    store.open = split.open = quota_open(directory, int(quota))  # module globals shadow open


def replay(workdir: str, out: str) -> None:
    import jax
    import numpy as np

    from ac2_jax.models.io.hf_io import load_hf_checkpoint
    from ac2_jax.models.io.params_io import latest_published, load_published
    from ac2_jax.trace import TraceStore
    from ac2_jax.training.rl.split import StepMarkers, StoreCollector
    from ac2_jax.training.rl.trainer import RLTrainer
    from experiments.calculator import agent as calculator_agent
    from experiments.rl_split.config import get_config

    cfg = json.load(open(os.path.join(workdir, "fault_config.json")))
    c = get_config("toy")
    c.rl.steps = cfg["steps"]
    rl = calculator_agent.typed_configs(c)["rl"]
    store = TraceStore(os.path.join(workdir, "rl", "rollouts.jsonl"))
    model, _ = load_hf_checkpoint(os.path.join(workdir, "policy"))
    collector = StoreCollector(store, StepMarkers.of(store), tasks_per_step=rl.tasks_per_step,
                               attempts_per_task=rl.attempts_per_task,
                               max_staleness=rl.batch.max_staleness, timeout_s=5)
    trainer = RLTrainer(model, collector, rl, os.path.join(workdir, "replay"))
    history = asyncio.run(trainer.run())
    trainer.close()
    mine = trainer.model()
    faulted, _ = load_hf_checkpoint(os.path.join(workdir, "policy"))
    published = os.path.join(workdir, "rl", "published")
    step = load_published(faulted, published)
    a = jax.tree.leaves(jax.tree.map(np.asarray, __import__("flax").nnx.state(mine)))
    b = jax.tree.leaves(jax.tree.map(np.asarray, __import__("flax").nnx.state(faulted)))
    diff = max(float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
               for x, y in zip(a, b, strict=True))
    with open(out, "w") as f:
        json.dump({"replay_version": trainer.version, "faulted_published": step,
                   "latest_published": latest_published(published),
                   "steps": [int(m["rl_step"]) for m in history],
                   "dtypes": sorted({str(x.dtype) for x in a}),
                   "max_abs_diff": diff}, f)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "replay":
        replay(sys.argv[2], sys.argv[3])
        return
    if os.environ.get("AC2_FAULT_JOURNAL"):
        _install_journal(os.environ["AC2_FAULT_JOURNAL"])
    if os.environ.get("AC2_FAULT_QUOTA"):
        _install_quota(os.environ["AC2_FAULT_QUOTA"])
    from absl import app

    from experiments.rl_split import run as rl_split

    app.run(rl_split.main)


if __name__ == "__main__":
    main()
