"""What the drift alarm costs an RL step: RLTrainer steps with the alarm on (drift
from the loss's own forward, `objectives.drift_sums`), off, and on the way
issue 65 first built it (one more learner forward of the batch before each
update: a loss kind without the drift sums takes that path), side by side in one
process on one machine (issue 65 review).

Each variant trains `--steps` RL steps on the same replayed traces (random
completions, recorded log-probs = the learner's plus noise, so drift is real but
under the threshold); the first `--warmup` steps (compiles) are dropped;
reported: the median `time_training_s` (pack + update + alarm) per variant, and
the ratio to "off". Variants run interleaved, step by step, so load drifts hit
all alike.

    python -m benchmarks.bench_alarm_cost --steps 8 --warmup 2
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ac2_jax.models import Decoder, DecoderConfig  # noqa: E402
from ac2_jax.trace import Completion, Trace, TraceRecorder  # noqa: E402
from ac2_jax.training import OptimizerConfig, PolicyGradientLoss  # noqa: E402
from ac2_jax.training.rl.alarms import AlarmConfig, AlarmsConfig  # noqa: E402
from ac2_jax.training.rl.data import BatchConfig  # noqa: E402
from ac2_jax.training.rl.trainer import ReplayCollector, RLConfig, RLTrainer  # noqa: E402
from benchmarks.common import parser  # noqa: E402


class ExtraForwardTrainer(RLTrainer):
    """RLTrainer measuring drift the way 714badb did for every loss: one more
    learner forward of the batch before each update (the path an objective that is
    no PolicyGradientLoss kind still takes)."""

    @property
    def _drift_in_step(self) -> bool:
        return False


def traces(steps, tasks, attempts, prompt, completion, vocab, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for s in range(steps):
        for t in range(tasks):
            for a in range(attempts):
                tr = Trace(
                    task_id=f"t{t}",
                    attempt_id=str(a),
                    group_id=f"g{s}:{t}",
                    reward=float(a % 2),
                    status="finished",
                    metadata={"rl_step": s},
                )
                ids = rng.integers(0, vocab - 1, completion).tolist()
                lps = rng.normal(-np.log(vocab), 0.01, completion).tolist()
                TraceRecorder(tr).record(
                    "main",
                    Completion(
                        rng.integers(0, vocab - 1, prompt).tolist(), ids, lps, policy_version=s
                    ),
                )
                out.append(tr)
    return out


def main():
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--rows", type=int, default=8)
    args = p.parse_args()
    cfg = DecoderConfig.tiny(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_layers=args.layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=args.hidden // 4,
        max_position_embeddings=args.seq_len,
    )
    # rows x seq_len filled: 2 tasks x (rows / 2) attempts of one row each.
    attempts = args.rows // 2
    data = traces(args.steps, 2, attempts, 16, args.seq_len - 17, args.vocab)
    quiet = AlarmConfig(threshold=1e9)  # measured, never fired
    variants = {
        "off": (PolicyGradientLoss(), AlarmsConfig(drift=AlarmConfig(1e9, "off"))),
        "on (step's forward)": (PolicyGradientLoss(), AlarmsConfig(drift=quiet)),
        "on (extra forward, 714badb)": (PolicyGradientLoss(), AlarmsConfig(drift=quiet)),
    }
    times = {k: [] for k in variants}
    tmp = tempfile.mkdtemp()
    trainers = {}
    for k, (loss, alarms) in variants.items():
        model = Decoder(cfg, rngs=nnx.Rngs(0))
        config = RLConfig(
            steps=args.steps,
            tasks_per_step=2,
            attempts_per_task=attempts,
            batch=BatchConfig(seq_len=args.seq_len, rows=args.rows),
            loss=loss,
            optimizer=OptimizerConfig(learning_rate=1e-5),
        )
        cls = ExtraForwardTrainer if "extra" in k else RLTrainer
        trainers[k] = cls(
            model,
            ReplayCollector(data),
            config,
            os.path.join(tmp, str(len(trainers))),
            alarms=alarms,
        )
    for s in range(args.steps):
        for k, tr in trainers.items():
            batch = [t for t in data if t.metadata["rl_step"] == s]
            start = time.perf_counter()
            m = tr.update(batch)
            jax.block_until_ready(tr.trainer.state.params)
            times[k].append(time.perf_counter() - start)
            assert m.get("skipped_update") == 0.0, m
            if k != "off":
                assert m["drift/onpolicy_tokens"] > 0, m  # measured on-policy
            extra = tr.step_fn._logprobs is not None  # the extra forward was compiled
            assert extra == ("extra" in k), (k, extra)
    base = statistics.median(times["off"][args.warmup :])
    print(
        f"RL step (pack + update + drift alarm), median of {args.steps - args.warmup} "
        f"steps after {args.warmup} warm-up, hidden {args.hidden}, layers {args.layers}, "
        f"vocab {args.vocab}, [{args.rows}, {args.seq_len}] rows, "
        f"{jax.devices()[0].device_kind}:"
    )
    for k, v in times.items():
        med = statistics.median(v[args.warmup :])
        print(f"  {k:30s} {med * 1e3:8.1f} ms  x{med / base:.3f}")
    for tr in trainers.values():
        tr.close()


if __name__ == "__main__":
    main()
