"""Which traces train, and with what: failure taxonomy, staleness, group advantages.

The rules `batching` applies before it turns the kept traces into segments
and a packed batch (`build_batch`). Pure host-side functions, shared by the
sync and async loops so both build identical batches from identical traces.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from ac2_jax.segments.batch import pow2_bucket
from ac2_jax.trace.agents import agent_matches, check_agent_pattern
from ac2_jax.trace.types import Trace
from ac2_jax.training.rl.advantages import AdvantageEstimator, GRPOAdvantage
from ac2_jax.training.rl.branches import continued_path
from ac2_jax.training.rl.credit import CREDITS

STALE_POLICIES = ("drop", "downweight")
STALE_UNITS = ("trace", "token")  # BatchConfig.stale_unit
MOE_ROUTING = ("replay", "recompute")
MEAN_OVER = ("attempt", "problem")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts policies (`RLConfig.moe`; configs: `rl.moe.routing`).

    routing: "replay" trains every token through the experts the sampler routed
    it to, where the trace records them (Completion.routed_experts ->
    Segment.routing -> PackedBatch.routing; routing replay, R3); "recompute"
    lets the learner route every token itself (the batch carries no routing).
    Replay needs layout="flat" when traces record routing.
    """

    routing: str = "replay"

    def __post_init__(self):
        if self.routing not in MOE_ROUTING:
            raise ValueError(f"rl.moe.routing must be one of {MOE_ROUTING}, got {self.routing!r}")


@dataclasses.dataclass(frozen=True)
class OverlongShaping:
    """DAPO's overlong reward shaping (Yu et al. 2025, arXiv 2503.14476, eq. 13),
    `rl.batch.overlong`: with L the tokens an attempt sampled (all its
    completions), L_max = `max_tokens` and L_cache = `cache`, the reward gets

        0                              if L <= L_max - L_cache
        ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
        -1                             if L > L_max

    added before the advantages (counted: BatchStats.overlong_shaped traces and
    their overlong_penalty sum)."""

    max_tokens: int
    cache: int

    def __post_init__(self):
        if not 0 < self.cache <= self.max_tokens:
            raise ValueError(
                f"rl.batch.overlong: need 0 < cache <= max_tokens (DAPO uses max_tokens=20480, "
                f"cache=4096), got max_tokens={self.max_tokens}, cache={self.cache}"
            )

    def penalty(self, length: int) -> float:
        soft = self.max_tokens - self.cache
        if length <= soft:
            return 0.0
        if length <= self.max_tokens:
            return (soft - length) / self.cache
        return -1.0


@dataclasses.dataclass(frozen=True)
class BatchConfig:
    """How traces become a batch. `rows` is the minimum row count (static shapes); a
    batch that needs more grows to rows x 2^k (few distinct compiled shapes). To
    keep one shape, set rows to the most a step needs and `RLConfig.grad_accum`
    so that a step with less data skips its empty micro-batches."""

    seq_len: int = 256
    rows: int = 16
    rows_multiple: int = 1
    segment_mode: str = "episode"
    layout: str = "flat"
    normalize_std: bool = False
    # normalize_std divides each group's advantages by its reward std + 1e-6: the
    # population std (std_ddof=0, divides by n) or the sample std (std_ddof=1).
    std_ddof: int = 0
    # What the loss averages (with the loss mode "task_mean", whose "task" is one
    # trace: an attempt): "attempt" weighs every attempt with trained tokens the
    # same, so a problem with 8 attempts weighs 4x one with 2; "problem" averages a
    # group's attempts first, then the groups (each attempt's segment weight is
    # scaled by attempts / (groups x the group's attempts), `batch_segments`).
    mean_over: str = "attempt"
    # How ended traces train (DESIGN.md "Failures"): "finished" with the verifier's
    # reward, wrong answers included; "infra_error" never (no setting changes that).
    agent_error_reward: float | None = None  # None: the verifier's reward (0 if none)
    timed_out_reward: float | None = None  # None: timed-out traces are dropped
    failed: str | None = None  # removed (was "zero" | "drop"); setting it is an error
    max_staleness: int = 1  # policy versions a trace may lag the learner
    stale: str = "drop"  # older traces: dropped, or down-weighted
    stale_weight: float = 0.5
    # What max_staleness judges: "trace" (its oldest trained token: the whole trace is
    # dropped / down-weighted) or "token" (with stale="drop": each trained token alone;
    # the tokens lagging more leave the loss, counted in BatchStats.dropped_stale_tokens,
    # and a trace goes only when none of its trained tokens is fresh enough). "token"
    # keeps the fresh tail of a long generation that spans weight updates
    # (`JaxSampler(weight_swap="in_flight")`: Completion.output_versions).
    stale_unit: str = "trace"
    # Rows grow (seq_len x 2^k) up to this many tokens to hold a longer segment
    # whole; only past it is a segment's end cut (counted). None: 4 x seq_len.
    max_seq_len: int | None = None
    # Static capacities of the batch (PackedBatch.num_tasks / num_segments):
    # floors that keep the compiled step the same from step to step. 0: the
    # RLTrainer uses tasks_per_step x attempts_per_task for both (a batch with
    # more grows to the next power of two: one more compile, warned).
    task_capacity: int = 0
    segment_capacity: int = 0
    # Floor of the grammar-mask table's rows (PackedBatch.constraint_masks: distinct
    # masks of constrained tokens, the next power of two): a static shape like the
    # capacities above. 0: the batch's own count. Batches without a mask have none.
    mask_capacity: int = 0
    # Leave out groups whose kept traces all train with one reward (or that keep
    # fewer than two): advantage 0, they only dilute the loss (counted in
    # BatchStats.dropped_zero_advantage). RLConfig.dynamic_sampling turns it on.
    drop_zero_advantage: bool = False
    # Agent labels whose episodes train (None: every episode of every trace). An
    # exact label ("main", "compactor", "subagent:helper") or "subagent:*" (every
    # subagent). Left-out episodes still belong to the attempt (its reward and
    # advantage are unchanged) but put no tokens in the batch (counted in
    # BatchStats.excluded_episodes / excluded_agent_tokens); the task loss is the
    # agent-token-weighted mean of the segments that do train. E.g. the main-only
    # ablation: train_agents=("main",).
    train_agents: tuple[str, ...] | None = None
    # How rewards become advantages (`training.rl.advantages`, `rl.batch.advantage.kind`):
    # "grpo" (default: R - group mean, / std with normalize_std), "dr_grpo", "rloo",
    # "reinforce", "reinforce_pp".
    advantage: AdvantageEstimator = GRPOAdvantage()
    # DAPO's overlong reward shaping (`OverlongShaping`); None: off.
    overlong: OverlongShaping | None = None
    # Credit per turn (`training.rl.credit`): "trace" (one advantage per attempt),
    # "turn" (per-turn rewards, Env.turn_rewards or metadata["turn_rewards"], as returns-to-go
    # discounted by gamma) or "discount" (the final reward discounted back over turns).
    credit: str = "trace"
    gamma: float = 1.0

    def __post_init__(self):
        _check_train_agents(self.train_agents)
        self.advantage.check(self)
        if self.credit not in CREDITS:
            raise ValueError(f"BatchConfig.credit must be one of {CREDITS}, got {self.credit!r}")
        if not 0.0 < self.gamma <= 1.0:
            raise ValueError(f"BatchConfig.gamma must be in (0, 1], got {self.gamma!r}")
        if self.credit == "trace" and self.gamma != 1.0:
            raise ValueError(
                f"BatchConfig: gamma={self.gamma!r} discounts over turns, which credit='trace' "
                "(one advantage per attempt) does not have: set credit='turn' or 'discount', "
                "or leave gamma at 1"
            )
        if self.failed is not None:
            raise ValueError(
                f"BatchConfig.failed={self.failed!r} no longer exists: rollouts now end "
                "finished, agent_error, timed_out or infra_error, and infra_error (our fault) "
                "is never trained. Remove `failed` and set agent_error_reward (None = the "
                "verifier's reward) and timed_out_reward (None = drop); the old 'zero' was "
                "agent_error_reward=0.0, timed_out_reward=0.0"
            )
        for name in ("agent_error_reward", "timed_out_reward"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise ValueError(f"BatchConfig.{name} must be a finite number or None, got {v!r}")
        if self.mean_over not in MEAN_OVER:
            raise ValueError(
                f"BatchConfig.mean_over must be one of {MEAN_OVER}, got {self.mean_over!r}"
            )
        if self.std_ddof not in (0, 1):
            raise ValueError(
                f"BatchConfig.std_ddof must be 0 (population std) or 1 (sample std), "
                f"got {self.std_ddof!r}"
            )
        if self.stale not in STALE_POLICIES:
            raise ValueError(
                f"BatchConfig.stale must be one of {STALE_POLICIES}, got {self.stale!r}"
            )
        if self.stale_unit not in STALE_UNITS:
            raise ValueError(
                f"BatchConfig.stale_unit must be one of {STALE_UNITS}, got {self.stale_unit!r}"
            )
        if self.stale_unit == "token" and self.stale != "drop":
            raise ValueError(
                f"BatchConfig: stale_unit='token' judges each token alone and drops the "
                f"stale ones; it has no per-token down-weighting, so stale={self.stale!r} "
                "is refused: set stale='drop', or stale_unit='trace'"
            )
        if not 0.0 <= self.stale_weight <= 1.0:
            raise ValueError(
                f"BatchConfig.stale_weight must be in [0, 1] (it multiplies the "
                f"loss of stale traces), got {self.stale_weight!r}"
            )
        for name in ("task_capacity", "segment_capacity", "mask_capacity"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"BatchConfig.{name} must be >= 0 (0: from the RL config / the batch), "
                    f"got {getattr(self, name)}"
                )
        if self.max_seq_len is not None and self.max_seq_len < self.seq_len:
            raise ValueError(
                f"BatchConfig.max_seq_len ({self.max_seq_len}) must be >= seq_len "
                f"({self.seq_len}), or None for 4 x seq_len"
            )

    def row_len(self, longest: int) -> int:
        """Row length for a batch whose longest segment has `longest` tokens:
        seq_len, else seq_len x 2^k (few distinct shapes) up to max_seq_len."""
        if longest <= self.seq_len:
            return self.seq_len
        limit = self.max_seq_len or 4 * self.seq_len
        return min(self.seq_len * pow2_bucket(-(-longest // self.seq_len)), limit)


def _check_train_agents(agents) -> None:
    if agents is None:
        return
    how = (
        'pass a tuple of agent labels, e.g. train_agents=("main",) or ("main", "compactor", '
        '"subagent:*"), or None to train every episode'
    )
    if not isinstance(agents, tuple):
        raise ValueError(
            f"BatchConfig.train_agents must be a tuple or None, got "
            f"{type(agents).__name__} {agents!r}: {how}"
        )
    if not agents:
        raise ValueError(f"BatchConfig.train_agents=() would train nothing: {how}")
    for a in agents:
        try:
            check_agent_pattern(a, "BatchConfig.train_agents")
        except ValueError as e:
            raise ValueError(f"{e}; {how}") from None


def agent_trained(agent: str, train_agents: tuple[str, ...] | None) -> bool:
    """Whether episodes of `agent` train under `BatchConfig.train_agents`
    (None: all; exact labels; "subagent:*" matches every `subagent:<name>`)."""
    return agent_matches(agent, train_agents)


def trace_version(trace: Trace) -> int | None:
    """Oldest policy version that sampled any token of the trace; None for a trace
    without completions (it failed before calling the model). Staleness is judged
    on `trained_version`, which leaves out the completions that do not train."""
    versions = [c.policy_version for e in trace.episodes for c in e.completions]
    return min(versions) if versions else None


def trained_versions(trace: Trace, train_agents: tuple[str, ...] | None = None) -> list[int]:
    """The policy version of every trained token of `trace` (per token:
    `Completion.token_versions`): output tokens with loss mask > 0 on the
    continued path (`branches.continued_path`: not an unchosen response, not a
    response of a request whose choice is unknown), in an episode whose agent
    `train_agents` trains. Empty when nothing trains."""
    path, _ = continued_path(trace)
    versions: list[int] = []
    for ep in path.episodes:
        if not agent_trained(ep.agent, train_agents):
            continue
        for c in ep.completions:
            lo = len(c.prompt_ids)
            mask = ep.loss_mask[lo : lo + len(c.output_ids)]
            if any(mask):
                versions += [v for v, m in zip(c.token_versions(), mask, strict=True) if m]
    return versions


def trained_version(trace: Trace, train_agents: tuple[str, ...] | None = None) -> int | None:
    """Oldest policy version among the trained tokens of `trace` (`trained_versions`);
    None when nothing trains (or the trace has no completion): nothing of it is stale."""
    versions = trained_versions(trace, train_agents)
    return min(versions) if versions else None


@dataclasses.dataclass
class BatchStats:
    """What `select_traces` saw and skipped (every skip is counted)."""

    traces: int = 0
    finished: int = 0
    agent_errors: int = 0
    timed_out: int = 0
    dropped_timed_out: int = 0  # with timed_out_reward=None
    infra_errors: int = 0  # never trained (also: traces that never ended)
    dropped_no_reward: int = 0  # finished, but no reward was given
    dropped_stale: int = 0
    downweighted: int = 0
    # Per token (`Completion.token_versions`): trained tokens of the kept traces per
    # version lag behind the learner (before stale_unit="token" drops any), and the
    # tokens stale_unit="token" took out of the loss.
    token_lags: dict[int, int] = dataclasses.field(default_factory=dict)
    dropped_stale_tokens: int = 0
    empty: int = 0  # kept traces with no agent token (in their baseline)
    no_completions: int = 0  # of those, traces that never called the model (no version)
    row_len: int = 0  # the batch's row length (> seq_len when it grew)
    long_segments: int = 0  # segments over seq_len, kept whole in grown rows
    truncated_segments: int = 0  # segments over max_seq_len (their end is cut)
    truncated_agent_tokens: int = 0  # agent tokens those cuts took out of the loss
    unpredicted_agent_tokens: int = 0  # agent tokens at position 0 of a segment (no prediction)
    # Multi-response requests (`branches.continued_path`): responses not continued and
    # their sampled tokens; requests whose choice was not recorded (none of their
    # responses train) and the tokens of all their responses.
    unchosen_responses: int = 0
    unchosen_tokens: int = 0
    unknown_branch_groups: int = 0
    unknown_branch_tokens: int = 0
    excluded_episodes: int = 0  # episodes of kept traces whose agent is not in train_agents
    excluded_agent_tokens: int = 0  # their agent tokens (in no batch)
    lone_traces: int = 0  # kept traces alone in their group: advantage 0, no signal
    zero_advantage_groups: int = 0  # groups of kept traces with one reward (or one trace)
    dropped_zero_advantage: int = 0  # their traces, left out with drop_zero_advantage
    overlong_shaped: int = 0  # kept traces whose reward DAPO's overlong shaping changed
    overlong_penalty: float = 0.0  # the sum of those changes (<= 0)
    # Per-turn credit (BatchConfig.credit "turn" / "discount"): kept traces whose turns
    # got their per-turn rewards, and those that fell back to the final reward.
    turn_credit_traces: int = 0
    final_credit_traces: int = 0
    staleness_mean: float = 0.0
    staleness_max: int = 0
    # Trained tokens sampled under a grammar (re-scored under their replayed masks),
    # and the distinct masks among them (the rows of the batch's mask table).
    constrained_tokens: int = 0
    grammar_masks: int = 0
    # Tokens whose recorded MoE routing the learner replays (rl.moe.routing="replay").
    replayed_routing_tokens: int = 0
    # Agent tokens in the batch per agent label (after exclusions and cuts; 0 for a
    # label of the kept traces that put none in): `rl.metrics.batch_metrics` logs them.
    trained_tokens: dict[str, int] = dataclasses.field(default_factory=dict)


def select_traces(
    traces: Sequence[Trace], learner_version: int, config: BatchConfig
) -> tuple[list[Trace], list[float], BatchStats]:
    """Applies the failure and staleness rules. Returns (kept, weights, stats).

    Kept traces carry the reward they train with (a copy when the config
    replaced it); the inputs are not changed. Staleness is judged on the
    completions that train (`trained_version`: the continued path, the agents
    `config.train_agents` trains): an old unchosen response or an old episode of
    an agent that does not train never makes a trace stale. A trace without
    completions (`stats.no_completions`), or none that trains, has no policy
    version: it is never stale, trains no token, and counts in its group's
    baseline; the staleness figures are over traces that have a version.
    """
    stats = BatchStats(traces=len(traces))
    kept, weights, lags = [], [], []
    for t in traces:
        reward = _trained_reward(t, config, stats)
        if reward is None:
            continue
        if config.overlong is not None:
            p = config.overlong.penalty(sampled_tokens(t))
            if p:
                stats.overlong_shaped += 1
                stats.overlong_penalty += p
                reward += p
        if reward != t.reward:
            t = dataclasses.replace(t, reward=reward)
        versions, w = trained_versions(t, config.train_agents), 1.0
        if not versions:  # nothing trains, no version: never stale, in its baseline
            if not any(e.completions for e in t.episodes):
                stats.no_completions += 1
            lag = 0
        else:
            # "trace": the oldest token judges it; "token": it goes only when every
            # trained token is stale (batch_segments drops the stale ones).
            judged = max(versions) if config.stale_unit == "token" else min(versions)
            lag = max(0, learner_version - judged)
            lags.append(max(0, learner_version - min(versions)))
        if lag > config.max_staleness:
            if config.stale == "drop":
                stats.dropped_stale += 1
                continue
            w = config.stale_weight ** (lag - config.max_staleness)
            stats.downweighted += 1
        if not t.num_agent_tokens:
            stats.empty += 1
        for v in versions:
            k = max(0, learner_version - v)
            stats.token_lags[k] = stats.token_lags.get(k, 0) + 1
        kept.append(t)
        weights.append(w)
    if lags:
        stats.staleness_mean, stats.staleness_max = float(np.mean(lags)), int(max(lags))
    return kept, weights, stats


def _trained_reward(t: Trace, config: BatchConfig, stats: BatchStats) -> float | None:
    """The reward `t` trains with, or None when it is dropped (counted in `stats`)."""
    if t.status == "finished":
        stats.finished += 1
        if t.reward is None:
            stats.dropped_no_reward += 1
            return None
        return float(t.reward)
    if t.status == "agent_error":
        stats.agent_errors += 1
        if config.agent_error_reward is not None:
            return float(config.agent_error_reward)
        return float(t.reward or 0.0)
    if t.status == "timed_out":
        stats.timed_out += 1
        if config.timed_out_reward is None:
            stats.dropped_timed_out += 1
            return None
        return float(config.timed_out_reward)
    stats.infra_errors += 1  # our fault, or never ended: nothing to learn about the agent
    return None


def sampled_tokens(trace: Trace) -> int:
    """Tokens the model sampled in `trace` (the output of every completion)."""
    return sum(len(c.output_ids) for e in trace.episodes for c in e.completions)


def trace_rewards(traces: Sequence[Trace]) -> np.ndarray:
    """Each trace's reward as float64 (exact: the value the host compares), 0 when
    it has none (`select_traces` has already put the configured reward on the
    traces it keeps)."""
    return np.array([float(t.reward or 0.0) for t in traces], np.float64)


def group_name(trace: Trace) -> str:
    """The advantage group of a trace: its group_id, else its task."""
    return trace.group_id or trace.task_id


def trace_advantages(
    traces: Sequence[Trace],
    normalize_std: bool = False,
    std_ddof: int = 0,
    eps: float = 1e-6,
    *,
    estimator: AdvantageEstimator | None = None,
) -> np.ndarray:
    """One advantage per trace [len(traces)] (float32) from `estimator` (default
    GRPO's: `advantages.GRPOAdvantage`); a trace's group is its group_id (else its
    task). GRPO: A = R - mean(R of the group), divided by (std of the group + eps)
    with `normalize_std` (the population std, ddof 0, unless `std_ddof=1`: the
    sample std).

    Computed on the host in float64. Every estimator with a group baseline gives
    exactly 0 to each group that `informative_groups` calls uninformative (all
    rewards equal, or one trace): the advantages and the counters
    (`BatchStats.zero_advantage_groups`) come from the same exact comparison, so
    a tie of rewards fp32 cannot hold (0.7, 1/3) is never a signal. The rule for
    groups that failures thinned out: the baseline is the mean of the traces
    kept, so a trace left alone in its group gets advantage 0 and teaches
    nothing (`BatchStats.lone_traces` counts them); it is never compared with a
    reward from another group.
    """
    estimator = GRPOAdvantage() if estimator is None else estimator
    adv = estimator(
        trace_rewards(traces),
        [group_name(t) for t in traces],
        normalize_std=normalize_std,
        std_ddof=std_ddof,
        eps=eps,
    )
    return np.asarray(adv, np.float64).astype(np.float32)


def informative_groups(kept: Sequence[Trace]) -> set[str]:
    """Groups (`group_name`) of `kept` with at least two traces whose rewards differ
    (exact float comparison on the host): the only ones with non-zero advantages
    (`trace_advantages` zeroes the others). `kept`: traces as `select_traces`
    keeps them, carrying the reward they train with."""
    rewards: dict[str, set[float]] = collections.defaultdict(set)
    sizes = collections.Counter(group_name(t) for t in kept)
    for t in kept:
        rewards[group_name(t)].add(float(t.reward or 0.0))
    return {g for g, r in rewards.items() if sizes[g] >= 2 and len(r) > 1}


def check_sampled(trace: Trace) -> None:
    """Raises if a completion of `trace` whose output trains (loss mask > 0 on it)
    was decoded greedily (temperature 0): there is no behaviour distribution to
    take an importance ratio against. Call it on the trace as it trains (after
    `continued_path` and the train_agents filter): greedy tokens that do not
    train (an excluded agent, an unchosen response) are no error."""
    for ep in trace.episodes:
        for c in ep.completions:
            lo, hi = len(c.prompt_ids), len(c.prompt_ids) + len(c.output_ids)
            if any(ep.loss_mask[lo:hi]) and not c.temperature > 0:
                raise ValueError(
                    f"trace {trace.key!r} ({ep.agent!r}) was sampled with temperature "
                    f"{c.temperature}: greedy tokens have no behaviour distribution, so RL "
                    "cannot train on them; collect RL rollouts with temperature > 0"
                )
