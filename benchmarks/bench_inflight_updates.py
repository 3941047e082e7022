"""Async RL with mixed short and long attempts: in-flight weight updates against
drain, side by side in one run (issue 65).

    python -m benchmarks.bench_inflight_updates --out bench_inflight.json

One process: a JaxSampler serving a small random decoder, a collector that
keeps `--concurrency` attempts in flight (every `--long_every`-th attempt asks
for `--long` tokens, the others for `--short`; no stop token, so each samples
exactly that many), and a learner that takes the first `--batch` finished
attempts, runs one real gradient step on them (REINFORCE-style loss on the
sampled tokens of the same decoder, fp32; rows padded to a power of two that
holds the batch's longest attempt), and publishes the new weights with
`set_weights` (version = step). It never waits for a rollout beyond its batch
(async RL: the attempts of a step were sampled by older versions); the
collector starts at most `(1 + --ahead) x --batch` attempts the learner has not
taken yet, which bounds the lag as the async trainer's max_staleness does.

The two modes differ only in `JaxSampler(weight_swap=)`:
- drain: new weights wait until every running row finishes, and new attempts
  wait with them, so a long attempt holds the sampler on the old weights;
- in_flight: swapped at the next decode chunk; the running rows' prefixes are
  prefilled again (KV rule recompute; `recomputed_tokens`).

Reported per mode (rounds alternate the modes; the figures are per round):
steps_per_s (learner steps / wall from the first attempt to the last step),
trained_tok_s, learner_wait_s (the learner waiting for its batch), latency
p50 / p95 of short and of long attempts (submit -> result, of the attempts that
finished inside the window), token_lag_mean (per trained token: step - the
version that sampled it), mixed_attempts (attempts sampled by more than one
version), in_flight_swaps, recomputed_tokens, decode_s / prefill_s of the sampler.
Compiles happen off the clock: a first, unreported run of each mode
(`--warm_steps`) fills the process's jit caches, then each measured run warms
its sampler up and compiles the train step before its clock starts.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ac2_jax.losses import token_logprobs
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.sampling import SamplingParams
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from benchmarks.common import machine, print_table, write_json

MODES = ("drain", "in_flight")
COLS = ["round", "mode", "steps_per_s", "trained_tok_s", "learner_wait_s", "short_p50_s",
        "short_p95_s", "long_p50_s", "long_p95_s", "token_lag_mean", "mixed_attempts",
        "in_flight_swaps", "recomputed_tokens", "decode_s", "prefill_s"]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--prompt_len", type=int, default=16)
    p.add_argument("--short", type=int, default=24, help="tokens of a short attempt")
    p.add_argument("--long", type=int, default=384, help="tokens of a long attempt")
    p.add_argument("--long_every", type=int, default=8, help="every n-th attempt is long")
    p.add_argument("--concurrency", type=int, default=8, help="attempts in flight")
    p.add_argument("--batch", type=int, default=8, help="attempts per learner step")
    p.add_argument("--steps", type=int, default=12, help="learner steps per round")
    p.add_argument("--ahead", type=int, default=1,
                   help="batches the collector may start beyond the one the learner trains "
                        "next (bounds staleness, as RLConfig.mode='async')")
    p.add_argument("--rounds", type=int, default=2, help="rounds (each runs both modes)")
    p.add_argument("--steps_per_sync", type=int, default=8)
    p.add_argument("--prefill_chunk", type=int, default=64)
    p.add_argument("--min_prefill_rows", type=int, default=1,
                   help="JaxSampler(min_prefill_rows=): the toy test sets --concurrency "
                        "(one prefill shape to compile)")
    p.add_argument("--no_sampler_warmup", action="store_true",
                   help="skip JaxSampler.warmup (toy runs: compile on first use)")
    p.add_argument("--warm_steps", type=int, default=2,
                   help="steps of an unreported first run of each mode (fills the jit caches)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write results as JSON here")
    return p.parse_args(argv)


def _config(a) -> DecoderConfig:
    return DecoderConfig.tiny(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        num_layers=a.layers, num_heads=a.heads, num_kv_heads=a.kv_heads,
        head_dim=a.hidden // a.heads, max_position_embeddings=_ctx(a),
        initializer_range=0.2,
    )  # fmt: skip


def _ctx(a) -> int:
    need = a.prompt_len + max(a.short, a.long) + 1
    return 1 << (need - 1).bit_length()


@functools.cache
def _initial(config: DecoderConfig, seed: int) -> Decoder:
    """The initial decoder of (config, seed), made once per process: every run's
    learner and sampler start from a copy (`nnx.clone`), not a new init."""
    return Decoder(config, rngs=nnx.Rngs(seed))


@functools.cache
def _step_fn(graphdef, lr: float):
    """The jitted SGD step of `graphdef`'s model: one per model and lr, so the
    runs of both modes share its compiles."""

    @jax.jit
    def step(params, rest, tokens, segs, mask, adv):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)

        def loss(p):
            logits = nnx.merge(graphdef, p, rest)(tokens, positions, segs)
            lp = token_logprobs(logits[:, :-1], tokens[:, 1:])
            return -(lp * mask[:, 1:] * adv[:, None]).sum() / jnp.maximum(mask.sum(), 1.0)

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda w, g: w - lr * g, params, grads), value

    return step


class Learner:
    """One jitted REINFORCE-style gradient step (SGD) on [batch, ctx] rows."""

    def __init__(self, config: DecoderConfig, seed: int, lr: float, batch: int, ctx: int):
        self.model = nnx.clone(_initial(config, seed))
        self.graphdef, self.params, self.rest = nnx.split(self.model, nnx.Param, ...)
        self.shape = (batch, ctx)
        self._step = _step_fn(self.graphdef, lr)

    def lengths(self) -> list[int]:
        """The row lengths a step pads to: powers of two from 32 up to ctx."""
        out, n = [], 32
        while n < self.shape[1]:
            out.append(n)
            n *= 2
        return out + [self.shape[1]]

    def compile(self) -> None:
        """Runs the step once per row length on an empty batch, keeping the weights."""
        for S in self.lengths():
            z = np.zeros((self.shape[0], S), np.int32)
            out = self._step(self.params, self.rest, z, z, z.astype(np.float32),
                             np.zeros(self.shape[0], np.float32))  # fmt: skip
            jax.block_until_ready(out)

    def train(self, attempts: list, rng: np.random.Generator) -> int:
        """One step on the attempts [(prompt, result)], rows padded to the smallest
        of `lengths()` that holds the longest; returns the trained tokens."""
        longest = max((len(p) + len(r.output_ids) for p, r in attempts), default=1)
        B, S = self.shape[0], next(n for n in self.lengths() if n >= longest)
        tokens, segs, mask = (np.zeros((B, S), np.int32) for _ in range(3))
        for i, (prompt, r) in enumerate(attempts):
            seq = prompt + r.output_ids
            tokens[i, : len(seq)], segs[i, : len(seq)] = seq, 1
            mask[i, len(prompt) : len(seq)] = 1
        adv = rng.standard_normal(B).astype(np.float32)
        self.params, loss = self._step(
            self.params, self.rest, tokens, segs, mask.astype(np.float32), adv
        )
        jax.block_until_ready(loss)
        nnx.update(self.model, self.params)
        return int(mask.sum())


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return float(np.percentile(xs, q))


async def run_mode(a, mode: str, rnd: int) -> dict:
    cfg, ctx = _config(a), _ctx(a)
    learner = Learner(cfg, a.seed, a.lr, a.batch, ctx)
    # max_top_logprobs=0: no attempt asks for them (the decode chunk compiles without).
    sampler = JaxSampler(
        nnx.clone(_initial(cfg, a.seed)), max_context=ctx, max_batch=a.concurrency,
        min_batch=a.concurrency, min_cache_len=ctx, steps_per_sync=a.steps_per_sync,
        prefill_chunk=a.prefill_chunk, min_prefill_rows=a.min_prefill_rows,
        max_top_logprobs=0, seed=a.seed, weight_swap=mode,
    )  # fmt: skip
    rng = np.random.default_rng(a.seed)
    with sampler:
        if not a.no_sampler_warmup:
            sampler.warmup()
        learner.compile()
        done: asyncio.Queue = asyncio.Queue()
        latency: dict[str, list[float]] = {"short": [], "long": []}
        counter = iter(range(1 << 30))

        async def attempt():
            i = next(counter)
            kind = "long" if i % a.long_every == 0 else "short"
            n = a.long if kind == "long" else a.short
            prompt = [int(x) for x in rng.integers(0, a.vocab, a.prompt_len)]
            sp = SamplingParams(temperature=1.0, max_tokens=n, seed=a.seed * 100003 + i)
            t0 = time.perf_counter()
            r = await sampler.generate(prompt, sp)
            latency[kind].append(time.perf_counter() - t0)
            await done.put((prompt, r))

        # At most (1 + ahead) batches started and not yet taken by the learner.
        window = asyncio.Semaphore((1 + a.ahead) * a.batch)

        async def slot():
            while True:
                await window.acquire()
                await attempt()

        t_start = time.perf_counter()
        slots = [asyncio.ensure_future(slot()) for _ in range(a.concurrency)]
        wait_s, tokens, lags, mixed = 0.0, 0, [], 0
        try:
            for step in range(1, a.steps + 1):
                t0 = time.perf_counter()
                batch = [await done.get() for _ in range(a.batch)]
                wait_s += time.perf_counter() - t0
                for _ in batch:
                    window.release()
                for _, r in batch:
                    vs = r.token_versions()
                    lags += [step - 1 - v for v in vs]  # the learner is at version step - 1
                    mixed += len(set(vs)) > 1
                tokens += await asyncio.to_thread(learner.train, batch, rng)
                await asyncio.to_thread(sampler.set_weights, learner.model, step)
            wall = time.perf_counter() - t_start
        finally:
            for s in slots:
                s.cancel()
            await asyncio.gather(*slots, return_exceptions=True)
        st = sampler.stats
        return {
            "round": rnd, "mode": mode, "wall_s": wall, "steps": a.steps,
            "steps_per_s": a.steps / wall, "trained_tok_s": tokens / wall,
            "learner_wait_s": wait_s,
            "short_p50_s": _pct(latency["short"], 50), "short_p95_s": _pct(latency["short"], 95),
            "long_p50_s": _pct(latency["long"], 50), "long_p95_s": _pct(latency["long"], 95),
            "short_done": len(latency["short"]), "long_done": len(latency["long"]),
            "token_lag_mean": statistics.fmean(lags) if lags else 0.0,
            "mixed_attempts": mixed, "weight_swaps": st.weight_swaps,
            "in_flight_swaps": st.in_flight_swaps, "recomputed_tokens": st.recomputed_tokens,
            "decode_s": st.decode_s, "prefill_s": st.prefill_s,
            "output_tokens": st.output_tokens,
        }  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    a = parse(sys.argv[1:] if argv is None else argv)
    rows = []
    warm = argparse.Namespace(**{**vars(a), "steps": a.warm_steps})
    for mode in MODES:  # every compile of either mode, off the clock
        if a.warm_steps:
            asyncio.run(run_mode(warm, mode, -1))
    for rnd in range(a.rounds):
        for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
            rows.append(asyncio.run(run_mode(a, mode, rnd)))
    print_table(rows, COLS)
    summary = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {
            k: statistics.median([r[k] for r in mine if r[k] is not None])
            for k in ("steps_per_s", "trained_tok_s", "short_p50_s", "short_p95_s",
                      "long_p50_s", "long_p95_s", "token_lag_mean", "learner_wait_s")
            if any(r[k] is not None for r in mine)
        }  # fmt: skip
    print("median over rounds:", summary)
    write_json(a.out, {"config": vars(a), "rows": rows, "summary": summary})
    return rows


if __name__ == "__main__":
    main()
    print(machine())
