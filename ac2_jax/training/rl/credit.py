"""Credit per turn: advantages per request of an episode instead of one per attempt.

`BatchConfig.credit` (configs: `rl.batch.credit`, `rl.batch.gamma`):

    "trace"     (default) every trained token of an attempt gets the attempt's one
                advantage (`data.trace_advantages`).
    "turn"      the trace carries a reward per request: what an env's
                `Env.turn_rewards` returned (`orchestration.run_rollout` records it
                in `metadata["artifacts"]["turn_rewards"]`, one per turn of a
                one-episode attempt), or `Trace.metadata["turn_rewards"]` set by
                whatever else scores the steps (a harness, a pass over stored
                traces), one list per episode (in `trace.episodes` order) with one
                float per completion of that episode. Turn k of an
                episode with K turns gets the return-to-go
                G_k = sum_{k' >= k} gamma^(k' - k) r_k'.
                A trace without them (or not "finished": an agent error or a
                timeout trains with its configured reward) falls back to its
                reward at its last turn, as below. DAPO's overlong penalty
                (`rl.batch.overlong`), which shapes the attempt's reward, is added
                to the last turn's reward of each episode.
    "discount"  the final reward discounted back over the turns:
                G_k = gamma^(K - 1 - k) R.

The advantage of turn k is the configured estimator (`rl.batch.advantage`)
applied to the returns G_k of the attempts of one problem at that turn: the
group key is (problem, agent label, k), so a group-relative baseline compares
turn k with turn k. Each request's output tokens then carry its turn's
advantage (the ADVANTAGES feature varies within a segment); the normaliser is
unchanged (every trained token still counts in its attempt's N_task). The
trace records the per-turn rewards it was given (metadata["turn_rewards"]);
`BatchStats.turn_credit_traces` / `final_credit_traces` count which credit
each trained attempt got.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

import numpy as np

from ac2_jax.trace.types import Trace

CREDITS = ("trace", "turn", "discount")
TURN_REWARDS = "turn_rewards"  # Trace.metadata key: [[reward per completion] per episode]


def check_turn_rewards(trace: Trace) -> list[list[float]] | None:
    """The trace's per-turn rewards as floats, or None when it has none; a list that
    does not match its episodes and their completions is an error naming the trace.

    Read from metadata["turn_rewards"] (one list per episode), else from what an env's
    `turn_rewards` recorded through the endpoint, `metadata["artifacts"]["turn_rewards"]`
    (one per assistant turn: it applies to a trace of one episode, one completion per
    turn; anything else is an error naming the counts)."""
    raw = trace.metadata.get(TURN_REWARDS)
    if raw is None:
        artifacts = trace.metadata.get("artifacts")
        flat = artifacts.get(TURN_REWARDS) if isinstance(artifacts, dict) else None
        if flat is None:
            return None
        sizes = [len(e.completions) for e in trace.episodes]
        if len(sizes) != 1 or sizes[0] != len(flat):
            raise ValueError(
                f"trace {trace.key!r}: the env gave {len(flat)} per-turn rewards (Env."
                f"turn_rewards) but the trace has {len(sizes)} episodes of {sizes} "
                "completions; a flat list applies to one episode with one completion per "
                "turn (else set metadata['turn_rewards'] per episode)"
            )
        raw = [list(flat)]
    shape = [len(e.completions) for e in trace.episodes]
    if (
        not isinstance(raw, (list, tuple))
        or [len(x) if isinstance(x, (list, tuple)) else -1 for x in raw] != shape
    ):
        raise ValueError(
            f"trace {trace.key!r}: metadata[{TURN_REWARDS!r}] must hold one list per episode "
            f"with one reward per completion (shape {shape}), got {raw!r}"
        )
    out = [[float(r) for r in x] for x in raw]
    if not all(math.isfinite(r) for x in out for r in x):
        raise ValueError(
            f"trace {trace.key!r}: per-turn rewards must be finite numbers, got {out!r}"
        )
    return out


def turn_returns(
    trace: Trace, credit: str, gamma: float, shaping: float = 0.0
) -> tuple[list[np.ndarray], bool]:
    """(per episode: the return G_k of each of its completions, float64; whether the
    trace's per-turn rewards were used). `trace.reward` is the reward it trains with
    (`select_traces` put it there, overlong shaping included); `shaping`: the overlong
    penalty in it, added to each episode's last per-turn reward when those are used
    (the final reward, which they replace, carries it otherwise)."""
    given = check_turn_rewards(trace) if credit == "turn" and trace.status == "finished" else None
    out = []
    for i, ep in enumerate(trace.episodes):
        k = len(ep.completions)
        if given is not None:
            r = np.asarray(given[i], np.float64)
            if k:
                r[-1] += shaping
        else:
            r = np.zeros(k, np.float64)
            if k:
                r[-1] = float(trace.reward or 0.0)
        g = np.zeros(k, np.float64)
        acc = 0.0
        for j in range(k - 1, -1, -1):
            acc = r[j] + gamma * acc
            g[j] = acc
        out.append(g)
    return out, given is not None


def turn_advantages(
    traces: Sequence[Trace],
    credit: str,
    gamma: float,
    estimator,
    *,
    group_of,
    normalize_std: bool = False,
    std_ddof: int = 0,
    shaping_of=None,
) -> tuple[list[list[np.ndarray]], int]:
    """Per trace, per episode: the advantage of each completion (float64), and how
    many traces used their per-turn rewards. `estimator`: an `AdvantageEstimator`,
    applied per (group_of(trace), agent, turn index) over the returns. `shaping_of`:
    trace -> the overlong penalty in its reward (`turn_returns`), None for none."""
    returns, used = [], 0
    for t in traces:
        g, u = turn_returns(t, credit, gamma, shaping_of(t) if shaping_of else 0.0)
        returns.append(g)
        used += u
    slots: dict[tuple, list[tuple[int, int, int]]] = collections.defaultdict(list)
    for ti, t in enumerate(traces):
        for ei, ep in enumerate(t.episodes):
            for k in range(len(ep.completions)):
                slots[(group_of(t), ep.agent, k)].append((ti, ei, k))
    adv = [[np.zeros_like(g) for g in gs] for gs in returns]
    keys = sorted(slots)
    flat = [(key, pos) for key in keys for pos in slots[key]]
    values = np.array([returns[ti][ei][k] for _, (ti, ei, k) in flat], np.float64)
    names = [repr(key) for key, _ in flat]
    a = estimator(values, names, normalize_std=normalize_std, std_ddof=std_ddof)
    for (_, (ti, ei, k)), v in zip(flat, a, strict=True):
        adv[ti][ei][k] = v
    return adv, used


def episode_token_advantages(ep, turn_adv: np.ndarray) -> np.ndarray:
    """float32 [len(ep.token_ids)]: each completion's output span carries its turn's
    advantage (0 elsewhere: prompts and tool results, which never train)."""
    out = np.zeros(len(ep.token_ids), np.float32)
    for c, a in zip(ep.completions, turn_adv, strict=True):
        lo = len(c.prompt_ids)
        out[lo : lo + len(c.output_ids)] = a
    return out
