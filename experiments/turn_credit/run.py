"""Per-turn credit vs the final reward alone on a two-turn toy env (issue 64).

The env: problem q (token 2 + i) asks for the answer token 8 + i in turn 1; turn 2
(after a fixed user token) is a free 4-token reply that the outcome ignores. The
outcome R = 1[turn-1 answer correct] decides everything, so turn 1 is where the
credit belongs. Arms, same model, data stream and optimiser, seed by seed:

    final  rl.batch.credit="trace": every token of the attempt gets R - mean(R);
           turn 2's 4 tokens are trained on R too (credit they did not earn).
    turn   rl.batch.credit="turn", turn rewards [R, 0]: turn 1 gets R - mean(R),
           turn 2 gets 0 (a tied turn).

The figure: the first turn's exact success probability p1 = mean over problems of
pi(answer | problem) after each step (from the logits, no sampling noise), per arm
and as the paired difference turn - final over seeds (95% t-intervals).

The policy samples here with plain categorical sampling from the tiny decoder (no
endpoint: the toy needs no tools); everything after the traces is the library's
RL pipeline (`batch_segments`, `pack_rl_batch`, `make_train_step` with the default
PPO loss). `python -m experiments.turn_credit --seeds 5 --steps 40` writes
results.json and prints the table (docs/notes/2026-12-07-rl-objectives-advantages-kl-turn-credit.md); `--optimizer adamw_noclip`
or `--optimizer sgd --learning_rate 0.5` locate where the gap comes from.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ac2_jax.evals import mean_interval
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.trace import Completion, Trace, TraceRecorder
from ac2_jax.training import BatchConfig, OptimizerConfig, PolicyGradientLoss, create_train_state
from ac2_jax.training.core.train_step import StepCache
from ac2_jax.training.rl import batch_segments, pack_rl_batch

VOCAB, BOS, USER2, TURN2 = 16, 1, 12, 4


@dataclasses.dataclass(frozen=True)
class Setup:
    problems: int = 4
    attempts: int = 8
    steps: int = 40
    learning_rate: float = 3e-3
    # "adamw" (the library's default: AdamW, global-norm clip 1.0), "adamw_noclip", or
    # "sgd" (plain gradient descent): which part of the update the arms' gap comes from.
    optimizer: str = "adamw"


def make_optimizer(setup: Setup):
    if setup.optimizer == "adamw":
        return OptimizerConfig(learning_rate=setup.learning_rate)
    if setup.optimizer == "adamw_noclip":
        return OptimizerConfig(learning_rate=setup.learning_rate, clip_norm=None)
    if setup.optimizer == "sgd":
        return optax.sgd(setup.learning_rate)
    raise ValueError(f"--optimizer must be adamw, adamw_noclip or sgd, got {setup.optimizer!r}")


def answer(q: int) -> int:
    return q + 6


WIDTH = 2 + 1 + 1 + TURN2  # every row is padded to the full episode: one compile


def _next_logp(graphdef, params, rest, tokens, n):
    """log softmax of the token after the first n tokens of each row (tokens [B, WIDTH],
    zero-padded after n: causal attention never reads the padding)."""
    model = nnx.merge(graphdef, params, rest)
    b, w = tokens.shape
    pos = jnp.tile(jnp.arange(w), (b, 1))
    logits = model(tokens, pos, jnp.ones_like(tokens))
    return jax.nn.log_softmax(logits[:, n - 1].astype(jnp.float32), axis=-1)


_next = jax.jit(_next_logp, static_argnums=0)


def _padded(rows: np.ndarray) -> jnp.ndarray:
    return jnp.asarray(np.pad(rows, ((0, 0), (0, WIDTH - rows.shape[1]))))


def sample(graphdef, state, prompts: np.ndarray, n: int, key) -> tuple[np.ndarray, np.ndarray]:
    """n tokens after each prompt row, temperature 1: (tokens [B, n], log-probs [B, n])."""
    toks, lps, seq, length = [], [], _padded(prompts), prompts.shape[1]
    for _ in range(n):
        key, sub = jax.random.split(key)
        lp = _next(graphdef, state.params, state.rest, seq, length)
        t = jax.random.categorical(sub, lp)
        toks.append(t)
        lps.append(jnp.take_along_axis(lp, t[:, None], axis=1)[:, 0])
        seq = seq.at[:, length].set(t)
        length += 1
    return np.asarray(jnp.stack(toks, 1)), np.asarray(jnp.stack(lps, 1))


def first_turn_success(graphdef, state, problems: int) -> float:
    qs = np.arange(problems) + 2
    rows = np.stack([np.full(problems, BOS), qs], 1)
    lp = np.asarray(_next(graphdef, state.params, state.rest, _padded(rows), 2))
    return float(np.mean(np.exp(lp[np.arange(problems), [answer(q) for q in qs]])))


def collect(graphdef, state, setup: Setup, step: int, key, credit: str) -> list[Trace]:
    """One step's attempts: problems x attempts two-turn traces."""
    qs = np.repeat(np.arange(setup.problems) + 2, setup.attempts)
    p1 = np.stack([np.full(len(qs), BOS), qs], 1)
    k1, k2 = jax.random.split(key)
    a1, lp1 = sample(graphdef, state, p1, 1, k1)
    p2 = np.concatenate([p1, a1, np.full((len(qs), 1), USER2)], 1)
    a2, lp2 = sample(graphdef, state, p2, TURN2, k2)
    traces = []
    for i, q in enumerate(qs):
        r = float(a1[i, 0] == answer(int(q)))
        t = Trace(task_id=f"q{q}", attempt_id=f"{step}-{i}", group_id=f"{step}:q{q}", reward=r,
                  status="finished")
        rec = TraceRecorder(t)
        rec.record("main", Completion(p1[i].tolist(), a1[i].tolist(), lp1[i].tolist(),
                                      policy_version=step))
        rec.record("main", Completion(p2[i].tolist(), a2[i].tolist(), lp2[i].tolist(),
                                      policy_version=step))
        if credit == "turn":
            t.metadata["turn_rewards"] = [[r, 0.0]]
        traces.append(t)
    return traces


def run_arm(credit: str, seed: int, setup: Setup, cache: StepCache, opt) -> list[float]:
    """p1 before training and after each step. opt: `make_optimizer(setup)`, one object
    for the whole study (the cached train step keys on it)."""
    model = Decoder(DecoderConfig.tiny(vocab_size=VOCAB, num_layers=1), rngs=nnx.Rngs(seed))
    graphdef, state = create_train_state(model, opt, rng=seed)
    n = setup.problems * setup.attempts
    cfg = BatchConfig(seq_len=16, rows=n // 2, task_capacity=n, segment_capacity=n,
                      credit="turn" if credit == "turn" else "trace")
    step_fn = cache(graphdef, PolicyGradientLoss(), opt)
    state = step_fn.place(state)
    key = jax.random.PRNGKey(1000 + seed)  # the same sampling keys in both arms
    curve = [first_turn_success(graphdef, state, setup.problems)]
    for s in range(setup.steps):
        key, sub = jax.random.split(key)
        traces = collect(graphdef, state, setup, s, sub, credit)
        segments, stats, _ = batch_segments(traces, s, cfg)
        if segments and any(np.any(seg.features["advantages"] != 0) for seg in segments):
            state, _ = step_fn(state, pack_rl_batch(segments, stats.row_len, cfg))
        curve.append(first_turn_success(graphdef, state, setup.problems))
    return curve


def summarize(curves: dict[str, list[list[float]]], at: list[int]) -> dict:
    out: dict = {}
    for s in at:
        row = {}
        for arm, cs in curves.items():
            e = mean_interval([c[s] for c in cs])
            row[arm] = {"mean": e.mean, "low": e.low, "high": e.high, "n": e.n}
        d = mean_interval([t[s] - f[s] for t, f in zip(curves["turn"], curves["final"],
                                                         strict=True)])
        row["turn_minus_final"] = {"mean": d.mean, "low": d.low, "high": d.high, "n": d.n}
        out[str(s)] = row
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--problems", type=int, default=4)
    ap.add_argument("--attempts", type=int, default=8)
    ap.add_argument("--learning_rate", type=float, default=3e-3)
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw_noclip", "sgd"])
    ap.add_argument("--out", default="runs/turn_credit")
    args = ap.parse_args(argv)
    setup = Setup(args.problems, args.attempts, args.steps, args.learning_rate, args.optimizer)
    cache, curves, t0 = StepCache(), {"final": [], "turn": []}, time.perf_counter()
    opt = make_optimizer(setup)
    for seed in range(args.seeds):
        for arm in curves:
            curves[arm].append(run_arm(arm, seed, setup, cache, opt))
    at = sorted({s for s in (5, 10, 20, args.steps) if s <= args.steps})
    result = {"setup": dataclasses.asdict(setup), "seeds": args.seeds, "curves": curves,
              "summary": summarize(curves, at), "seconds": time.perf_counter() - t0}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"first-turn success p1 (mean [95% CI] over {args.seeds} seeds)")
    for s, row in result["summary"].items():
        cells = "  ".join(f"{k} {v['mean']:.3f} [{v['low']:.3f}, {v['high']:.3f}]"
                          for k, v in row.items())
        print(f"step {s:>3}: {cells}")
    return result


if __name__ == "__main__":
    main()
