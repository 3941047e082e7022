"""Weight hand-off learner -> sampler: Orbax publish, sampler.load_weights, first
completion on the new version; each part timed and set against one RL step.

For each model size: the learner runs `make_train_step` + `PolicyGradientLoss`
(AdamW, task_mean) on a representative RL batch (`--segments` segments of
`--seg_len` tokens, half prompt / half agent tokens, groups of 8 attempts with
rewards 0/1, packed into rows of seq_len); that is the train-step time. Then,
`--repeats` times: `training.publish` (the RLTrainer's call: params out of the
train state -> `publish_weights`, a finalized Orbax CheckpointManager step) ->
`JaxSampler.load_weights(step)` (Orbax restore into the sampler's model and a
snapshot for the worker) -> the first `generate` whose result carries
`policy_version == step` (weights swap in, one prefill + one decode chunk; the
sampler runs without prefix reuse so the same call on old weights costs the
same; the next call, `second_s`, is the baseline). `compiles` counts XLA
compiles during the timed hand-offs (0: no recompile after a swap).
Sampling time: the batch's prompts
(`--segments` x seg_len/2 tokens) sampled concurrently for seg_len/2 new
tokens (greedy, no stop), i.e. the rollout side of the same RL step.
`share_of_train` = (publish + load + first) / train step; `share_of_rl_step`
divides by train + sampling + hand-off.

    python -m benchmarks.bench_weight_publish --out bench_results/weight_publish.json
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from ac2_jax.models import Decoder, DecoderConfig  # noqa: E402
from ac2_jax.sampling import SamplingParams  # noqa: E402
from ac2_jax.sampling.engine.jax_sampler import JaxSampler  # noqa: E402
from ac2_jax.segments import pack_segments  # noqa: E402
from ac2_jax.training import (
    OptimizerConfig,
    PolicyGradientLoss,
    create_train_state,
    make_train_step,
    publish,
)
from ac2_jax.training.core import num_params
from ac2_jax.training.rl import rl_segment  # noqa: E402
from benchmarks.common import parser, print_table, write_json  # noqa: E402

_COMPILES = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _d, **_kw: _COMPILES.__setitem__(0, _COMPILES[0] + (
        event == "/jax/core/compile/backend_compile_duration")))

SIZES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                 num_heads=4, num_kv_heads=2, head_dim=16),
    "small": dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_layers=4,
                  num_heads=4, num_kv_heads=2, head_dim=32),
    "medium": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4,
                   num_heads=8, num_kv_heads=4, head_dim=32),
}


def config_of(name: str) -> DecoderConfig:
    if name not in SIZES:
        raise SystemExit(f"unknown size {name!r}; choose from {sorted(SIZES)}")
    return DecoderConfig(tie_embeddings=True, qk_norm=True, rope_theta=10000.0,
                         max_position_embeddings=1024, **SIZES[name])


def rl_batch(c: DecoderConfig, n: int, seg_len: int, seed: int = 0):
    """n segments: first half prompt (mask 0), second half agent tokens with
    advantages +-0.5 (groups of 8, half of them rewarded)."""
    rng = np.random.default_rng(seed)
    half = seg_len // 2
    segs = []
    for i in range(n):
        mask = np.r_[np.zeros(half), np.ones(seg_len - half)]
        lp = np.where(mask > 0, -rng.uniform(0.5, 3.0, seg_len), 0.0)
        segs.append(rl_segment(rng.integers(0, c.vocab_size, seg_len), mask, lp, task=f"t{i}",
                            advantage=0.5 if i % 2 else -0.5))
    return pack_segments(segs, seg_len), [s.tokens[:half].tolist() for s in segs]


def time_train(c: DecoderConfig, batch, steps: int):
    opt = OptimizerConfig(learning_rate=1e-5, weight_decay=0.0)
    graphdef, state = create_train_state(Decoder(c, rngs=nnx.Rngs(0)), opt)
    step = make_train_step(graphdef, PolicyGradientLoss(), opt)
    state = step.place(state)
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    if not np.isfinite(float(m["loss"])):
        raise RuntimeError(f"train step loss is not finite: {m['loss']}")
    return graphdef, state, statistics.median(times), first, num_params(state.params)


async def _sample(sampler, prompts, n_new):
    params = SamplingParams(temperature=0.0, max_tokens=n_new)
    res = await asyncio.gather(*(sampler.generate(p, params) for p in prompts))
    return res


def time_sampling(sampler, prompts, n_new, repeats: int) -> float:
    asyncio.run(_sample(sampler, prompts, n_new))  # compiles the shapes
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = asyncio.run(_sample(sampler, prompts, n_new))
        times.append(time.perf_counter() - t0)
        assert all(len(r.output_ids) == n_new for r in res)
    return statistics.median(times)


def time_handoff(graphdef, state, sampler, publish_dir, prompt, repeats: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def first(expect):
        t0 = time.perf_counter()
        r = asyncio.run(sampler.generate(prompt, params))
        dt = time.perf_counter() - t0
        if r.policy_version != expect:
            raise RuntimeError(f"completion carries version {r.policy_version}, expected {expect}")
        return dt

    # Warm-up: one full cycle (Orbax first-use costs, the restored arrays' shapes).
    publish(graphdef, state, publish_dir, 1)
    sampler.load_weights(1)
    first(1)
    first(1)
    parts = {"publish_s": [], "load_s": [], "first_s": [], "second_s": []}
    c0 = _COMPILES[0]
    for i in range(repeats):
        step = i + 2
        t0 = time.perf_counter()
        publish(graphdef, state, publish_dir, step)
        t1 = time.perf_counter()
        got = sampler.load_weights(step)
        t2 = time.perf_counter()
        assert got == step
        parts["first_s"].append(first(step))
        parts["second_s"].append(first(step))
        parts["publish_s"].append(t1 - t0)
        parts["load_s"].append(t2 - t1)
    out = {k: statistics.median(v) for k, v in parts.items()}
    out["compiles"] = _COMPILES[0] - c0
    return out


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.set_defaults(repeats=3)
    p.add_argument("--sizes", default="tiny,small,medium")
    p.add_argument("--segments", type=int, default=64)
    p.add_argument("--seg_len", type=int, default=256)
    p.add_argument("--train_steps", type=int, default=1, help="timed steps (after 1 warm-up)")
    p.add_argument("--no_sampling", action="store_true", help="skip the sampling-time column")
    args = p.parse_args(argv)
    rows = []
    for name in args.sizes.split(","):
        c = config_of(name)
        batch, prompts = rl_batch(c, args.segments, args.seg_len)
        graphdef, state, train_s, first_train_s, n_params = time_train(c, batch, args.train_steps)
        with tempfile.TemporaryDirectory(prefix="bench_publish_") as tmp:
            pub = os.path.join(tmp, "published")
            sampler = JaxSampler(Decoder(c, rngs=nnx.Rngs(1)), publish_dir=pub,
                                 max_context=args.seg_len, max_batch=args.segments,
                                 min_cache_len=args.seg_len, max_top_logprobs=0,
                                 prefix_reuse=False, steps_per_sync=16)
            try:
                n_new = args.seg_len - len(prompts[0])
                sample_s = (None if args.no_sampling
                            else time_sampling(sampler, prompts, n_new, 1))
                h = time_handoff(graphdef, state, sampler, pub, prompts[0], args.repeats)
                size_mb = dir_bytes(os.path.join(pub, str(args.repeats + 1))) / 1e6
            finally:
                sampler.close()
        handoff = h["publish_s"] + h["load_s"] + h["first_s"]
        row = {"size": name, "params_M": n_params / 1e6, "ckpt_MB": size_mb,
               "train_step_s": train_s, "sampling_s": sample_s, **h, "handoff_s": handoff,
               "share_of_train": handoff / train_s, "first_train_step_s": first_train_s}
        if sample_s is not None:
            row["share_of_rl_step"] = handoff / (train_s + sample_s + handoff)
        rows.append(row)
        print(row, flush=True)
    load = os.getloadavg()
    print(f"\nRL batch: {args.segments} segments x {args.seg_len} tokens (half agent tokens), "
          f"fp32, PolicyGradientLoss + AdamW; cpus {os.cpu_count()}, load average {load[0]:.1f}")
    print_table(rows, ["size", "params_M", "ckpt_MB", "train_step_s", "sampling_s", "publish_s",
                       "load_s", "first_s", "second_s", "handoff_s", "share_of_train",
                       "share_of_rl_step", "compiles"])
    write_json(args.out, {"benchmark": "weight_publish", "config": vars(args),
                          "load_average": load, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
