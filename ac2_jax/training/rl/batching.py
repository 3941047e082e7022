"""Selected traces -> their segments -> a packed RL batch (`build_batch`).

`batch_segments` applies the rules of `data` (failure taxonomy, staleness,
group advantages) and turns the kept traces into segments; `pack_rl_batch`
packs them into one PackedBatch, or one process's share of it. Split in two so
that every process of a multi-host learner computes the same segments and packs
only its share. Pure host-side functions, shared by the sync and async loops
so both build identical batches from identical traces.

Grammar-constrained completions (`Completion.constraint`) train under the
masks they were sampled with: `batch_segments(tokenizer=...)` replays them
(`ac2_jax.sampling.constraints.replay_masks`) for every trained output
token, the segments carry them (`segments_from_trace(constraint_masks=)`) and
`pack_rl_batch` numbers them batch-wide into the batch's table
(`PackedBatch.constraint_masks`, `BatchConfig.mask_capacity`); the loss
re-scores those tokens under their masks. A batch without one is packed
exactly as before (no table, no feature).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ac2_jax.segments import (
    CONSTRAINT_ID,
    POLICY_VERSION,
    PackedBatch,
    Segment,
    merge_constraint_tables,
    pack_segments,
    pad_batch_rows,
    resolve_constraints,
    routing_shape,
    segments_from_trace,
    task_names,
)
from ac2_jax.segments.batch import empty_batch, pad_rows, pow2_bucket
from ac2_jax.segments.segments import fit_segments
from ac2_jax.trace.types import Completion, Trace
from ac2_jax.training.rl.branches import BranchCounts, continued_path
from ac2_jax.training.rl.credit import episode_token_advantages, turn_advantages
from ac2_jax.training.rl.data import (
    BatchConfig,
    BatchStats,
    agent_trained,
    check_sampled,
    group_name,
    sampled_tokens,
    select_traces,
    trace_advantages,
)
from ac2_jax.training.rl.features import ADVANTAGES, RL_FEATURES, rl_segment, with_advantage


def build_batch(
    traces: Sequence[Trace],
    learner_version: int,
    config: BatchConfig,
    *,
    process_index: int = 0,
    process_count: int = 1,
    tokenizer: Any = None,
    vocab_size: int | None = None,
    moe_routing: str = "replay",
) -> tuple[PackedBatch | None, BatchStats, np.ndarray]:
    """Traces -> (packed batch or None when nothing trainable, stats, advantages):
    `batch_segments` then `pack_rl_batch`. With process_count > 1 the batch holds
    only process `process_index`'s share of the segments (a multi-host learner:
    every process selects from the same traces, packs its share, and the train
    step assembles the global batch); None when the global batch has no segment.
    tokenizer / vocab_size: for grammar-constrained completions (`batch_segments`);
    moe_routing: `MoEConfig.routing` ("recompute": the batch carries no routing).
    """
    segments, stats, adv = batch_segments(
        traces,
        learner_version,
        config,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        moe_routing=moe_routing,
    )
    if not segments:
        return None, stats, adv
    return (
        pack_rl_batch(
            segments,
            stats.row_len,
            config,
            process_index=process_index,
            process_count=process_count,
        ),
        stats,
        adv,
    )


def replayed_masks(tokenizer: Any, vocab_size: int | None = None) -> Callable[..., np.ndarray]:
    """completion -> packed uint32 [len(output_ids), ceil(V / 32)]: the grammar masks
    a constrained completion was sampled under, replayed with the sampler's tokenizer
    (`sampling.constraints.replay_masks(packed=True)`: the bits, never a bool
    [n, V] array; V = vocab_size, the model's, default the tokenizer's). What
    `segments_from_trace(constraint_masks=)` takes."""
    from ac2_jax.sampling.constraints import replay_masks

    def masks(c: Completion) -> np.ndarray:
        grammar = getattr(c, "constraint", None)
        if grammar is None:
            raise ValueError("replayed_masks: the completion has no constraint (grammar)")
        return replay_masks(grammar, tokenizer, c.output_ids, vocab_size=vocab_size, packed=True)

    return masks


def _check_can_replay(trace: Trace, tokenizer: Any) -> None:
    if tokenizer is not None:
        return
    for ep in trace.episodes:
        for c in ep.completions:
            lo, hi = len(c.prompt_ids), len(c.prompt_ids) + len(c.output_ids)
            if getattr(c, "constraint", None) is not None and any(ep.loss_mask[lo:hi]):
                raise ValueError(
                    f"trace {trace.key!r} ({ep.agent!r}) has a completion sampled under a "
                    "grammar (Completion.constraint, e.g. tool_choice='required') that "
                    "trains; the learner replays its masks with the sampler's tokenizer: "
                    "pass tokenizer= (RLTrainer(tokenizer=...), batch_segments / build_batch)"
                )


def batch_segments(
    traces: Sequence[Trace],
    learner_version: int,
    config: BatchConfig,
    *,
    tokenizer: Any = None,
    vocab_size: int | None = None,
    moe_routing: str = "replay",
    sources: list | None = None,
) -> tuple[list[Segment], BatchStats, np.ndarray]:
    """Traces -> (the batch's segments, stats, advantages); deterministic and
    host-side, so every process of a multi-host learner computes the same.
    `stats.row_len` is the row length to pack them with (`pack_rl_batch`).

    Advantages come from every selected trace's group; each trace's one
    advantage goes to all of its segments (the whole trace is one unit) and
    its staleness weight multiplies their loss. A segment longer than
    `config.seq_len` makes the batch's rows grow (`BatchConfig.row_len`) so it
    stays whole; only past `max_seq_len` is its end cut. Both are counted in
    the stats. Greedy tokens that train and two traces with one `Trace.key` are
    errors. Of a multi-response trace only the continued path trains
    (`branches.continued_path`: the other responses, and every response of a
    request whose choice is unknown, get loss mask 0; counted in
    `stats.unchosen_*` / `unknown_branch_*`); then episodes whose agent is
    not in `config.train_agents` (`stats.excluded_episodes` /
    `excluded_agent_tokens`): they shaped the reward, so the advantage is the
    whole attempt's, but they put no tokens in the batch. Trained tokens of
    grammar-constrained completions carry their replayed masks (`tokenizer`:
    the sampler's; `vocab_size`: the model's; without a tokenizer such a
    token is an error, never trained unmasked). The advantages come from
    `config.advantage` (`training.rl.advantages`); groups whose advantages are
    all 0 (with a group baseline: no reward spread) are counted
    (`stats.zero_advantage_groups`) and, with
    `config.drop_zero_advantage`, left out (`stats.dropped_zero_advantage`).
    With `config.mean_over="problem"` each segment's weight is scaled so the
    task_mean loss is a mean over groups of the mean over their attempts
    (tied groups stay in it, at loss 0, unless dropped).
    `sources` (a list, filled in): per returned segment, (its trace's
    "task_id/attempt_id", whether every completion of the trace was sampled by
    `learner_version`: on-policy), for the drift alarm (`training.rl.alarms`).
    """
    kept, weights, stats = select_traces(traces, learner_version, config)
    seen: set[str] = set()
    for t in kept:
        if t.key in seen:
            raise ValueError(
                f"build_batch: two traces share the key {t.key!r} (task_id/attempt_id)"
                "; give every attempt its own attempt_id, or their losses merge"
            )
        seen.add(t.key)
    turns: list | None = None  # per trace, per episode: each turn's advantage
    if config.credit == "trace":
        adv = trace_advantages(
            kept, config.normalize_std, config.std_ddof, estimator=config.advantage
        )
        live = [a != 0 for a in adv]
    else:
        overlong = config.overlong  # DAPO's penalty, in trace.reward: per-turn rewards get it too
        turns, used = turn_advantages(
            kept,
            config.credit,
            config.gamma,
            config.advantage,
            group_of=group_name,
            normalize_std=config.normalize_std,
            std_ddof=config.std_ddof,
            shaping_of=None if overlong is None else lambda t: overlong.penalty(sampled_tokens(t)),
        )
        stats.turn_credit_traces, stats.final_credit_traces = used, len(kept) - used
        # Per trace: the mean advantage over its turns (for the step's adv_* metrics).
        adv = np.array(
            [np.mean(np.concatenate(x)) if any(len(e) for e in x) else 0.0 for x in turns],
            np.float32,
        )
        live = [any(np.any(e != 0) for e in x) for x in turns]
    # Groups whose advantages are all 0 (with a group baseline: exactly the groups
    # `informative_groups` calls uninformative; REINFORCE's tied groups still push).
    signal = {group_name(t) for t, a in zip(kept, live, strict=True) if a}
    stats.zero_advantage_groups = len({group_name(t) for t in kept} - signal)
    if config.drop_zero_advantage:
        keep = [i for i, t in enumerate(kept) if group_name(t) in signal]
        stats.dropped_zero_advantage = len(kept) - len(keep)
        kept, weights, adv = [kept[i] for i in keep], [weights[i] for i in keep], adv[keep]
        turns = None if turns is None else [turns[i] for i in keep]
    if not kept:
        return [], stats, np.zeros(0, np.float32)
    sizes = collections.Counter(group_name(t) for t in kept)
    stats.lone_traces = sum(1 for n in sizes.values() if n == 1)
    segments = []
    stats.trained_tokens = {e.agent: 0 for t in kept for e in t.episodes}
    branches = BranchCounts()
    masks = None if tokenizer is None else replayed_masks(tokenizer, vocab_size)
    for i, (t, a, w) in enumerate(zip(kept, adv, weights, strict=True)):
        t, left_out = continued_path(t)  # never trained on the continued branch's reward
        branches.add(left_out)
        ep_adv = None if turns is None else list(turns[i])  # aligned with t.episodes
        if config.train_agents is not None:
            on = [agent_trained(e.agent, config.train_agents) for e in t.episodes]
            excluded = [e for e, o in zip(t.episodes, on, strict=True) if not o]
            if excluded:
                stats.excluded_episodes += len(excluded)
                stats.excluded_agent_tokens += sum(e.num_agent_tokens for e in excluded)
                t = dataclasses.replace(
                    t, episodes=[e for e, o in zip(t.episodes, on, strict=True) if o]
                )
                if ep_adv is not None:
                    ep_adv = [x for x, o in zip(ep_adv, on, strict=True) if o]
        check_sampled(t)  # only what trains
        _check_can_replay(t, tokenizer)
        per_token = None if ep_adv is None else _segment_advantages(t, ep_adv, config)
        for j, s in enumerate(
            segments_from_trace(t, mode=config.segment_mode, constraint_masks=masks, versions=True)
        ):
            if moe_routing == "recompute":  # MoEConfig.routing (rl.moe.routing)
                s.routing = None  # the learner routes every token itself
            if config.stale_unit == "token":  # each trained token judged alone
                # -1: a trained token no completion sampled has no version; never
                # stale (as select_traces judges a trace without one).
                v = s.features[POLICY_VERSION]
                stale = (s.loss_mask > 0) & (v >= 0) & (learner_version - v > config.max_staleness)
                if stale.any():
                    stats.dropped_stale_tokens += int(stale.sum())
                    s = dataclasses.replace(s, loss_mask=np.where(stale, 0.0, s.loss_mask))
            if s.num_agent_tokens:
                if per_token is None:
                    s = with_advantage(s, float(a))
                else:
                    s = s.with_features(**{ADVANTAGES: per_token[j]})
                s.weight = w
                segments.append(s)
                if sources is not None:
                    versions = {c.policy_version for e in t.episodes for c in e.completions}
                    sources.append((f"{t.task_id}/{t.attempt_id}", versions == {learner_version}))
    stats.unchosen_responses, stats.unchosen_tokens = (
        branches.unchosen_responses,
        branches.unchosen_tokens,
    )
    stats.unknown_branch_groups, stats.unknown_branch_tokens = (
        branches.unknown_groups,
        branches.unknown_tokens,
    )
    if not segments:
        return [], stats, adv
    row_len = config.row_len(max(len(s) for s in segments))
    stats.row_len = row_len
    stats.long_segments = sum(config.seq_len < len(s) <= row_len for s in segments)
    segments, cut = fit_segments(segments, row_len)
    stats.truncated_segments = cut.truncated_segments
    stats.truncated_agent_tokens = cut.truncated_agent_tokens
    stats.unpredicted_agent_tokens = cut.unpredicted_agent_tokens
    if config.mean_over == "problem":
        segments = _per_problem_weights(segments, {t.key: group_name(t) for t in kept})
    for s in segments:
        stats.trained_tokens[s.agent] += s.num_agent_tokens
        if s.routing is not None:
            stats.replayed_routing_tokens += int(np.all(s.routing >= 0, axis=(1, 2)).sum())
        if s.constraint_masks is not None:
            ids = s.features[CONSTRAINT_ID]
            stats.constrained_tokens += int(((ids > 0) & (s.loss_mask > 0)).sum())
    tables = [s.constraint_masks for s in segments if s.constraint_masks is not None]
    if tables:
        stats.grammar_masks = len({row.tobytes() for t in tables for row in np.asarray(t)})
    return segments, stats, adv


def _segment_advantages(t: Trace, ep_adv: list, config: BatchConfig) -> list[np.ndarray]:
    """Per segment of `segments_from_trace(t, config.segment_mode)`: the per-token
    advantages of its turns (`credit.episode_token_advantages`)."""
    if config.segment_mode == "episode":
        return [episode_token_advantages(e, x) for e, x in zip(t.episodes, ep_adv, strict=True)]
    out = []
    for e, x in zip(t.episodes, ep_adv, strict=True):
        for c, v in zip(e.completions, x, strict=True):
            n_p, n_o = len(c.prompt_ids), len(c.output_ids)
            out.append(np.concatenate([np.zeros(n_p, np.float32), np.full(n_o, v, np.float32)]))
    return out


def _per_problem_weights(segments: list[Segment], groups: dict[str, str]) -> list[Segment]:
    """`segments` with each attempt's weight scaled so that the task_mean loss (a
    mean over the T attempts with trained tokens) becomes a mean over the G groups
    of the mean over each group's n_g attempts: x T / (G n_g). Attempts without a
    trained token are in no count, as in task_mean."""
    present = {s.task for s in segments if s.num_agent_tokens}
    sizes = collections.Counter(groups[k] for k in present)
    scale = {k: len(present) / (len(sizes) * sizes[groups[k]]) for k in present}
    for s in segments:
        if s.task in scale:
            s.weight = s.weight * scale[s.task]
    return segments


def warmup_batch(
    config: BatchConfig, *, process_index: int = 0, process_count: int = 1
) -> PackedBatch:
    """A batch of the geometry `config` packs to when nothing grows: one trained
    token, `pack_rl_batch`'s rows, row length and static capacities. For compiling
    the step ahead (`RLTrainer.warmup_step`); never trained on."""
    seg = rl_segment(
        np.zeros(2, np.int32),
        np.array([0.0, 1.0], np.float32),
        np.zeros(2, np.float32),
        task="warmup",
        advantage=1.0,
    )
    return pack_rl_batch(
        [seg], config.seq_len, config, process_index=process_index, process_count=process_count
    )


def pack_rl_batch(
    segments: Sequence[Segment],
    row_len: int,
    config: BatchConfig,
    *,
    process_index: int = 0,
    process_count: int = 1,
) -> PackedBatch:
    """`batch_segments`' segments -> a PackedBatch of [rows, row_len].

    With process_count = n > 1: only this process's share (every n-th segment
    from process_index on, `distributed.process_share`), with the global task
    ids (`all_tasks`: every segment's task) and segment numbers (`segment_offset`),
    `config.rows` / `rows_multiple` divided among the n processes (rounded up),
    so the n shares make one global batch whose task_mean loss is exactly the
    one-process batch's (`distributed.global_batch` agrees rows and capacities).
    Grammar masks: the segments' tables are merged over all segments first, so
    every share carries the same global table (`constraint_masks`, at least
    `config.mask_capacity` rows) and ids.
    """
    n, i = int(process_count), int(process_index)
    if not 0 <= i < n:
        raise ValueError(f"pack_rl_batch: process_index {i} not in [0, {n})")
    rows, multiple = -(-config.rows // n), -(-max(config.rows_multiple, 1) // n)
    # Grammar masks numbered over the whole batch (every process alike), one table.
    segments, table = merge_constraint_tables(segments, "pack_rl_batch")
    routed = routing_shape(segments, "pack_rl_batch")  # every share carries it alike
    share, extra = list(segments), dict[str, Any]()
    if n > 1:
        if config.layout != "flat":
            raise ValueError(
                f"pack_rl_batch: a batch split over {n} processes needs "
                f"BatchConfig.layout='flat', got {config.layout!r}: set it to "
                "'flat' (experiments: --config.rl.batch.layout=flat); one share "
                "of a prefix-tree batch is not offered"
            )
        share = list(segments[i::n])
        extra = dict(
            all_tasks=task_names(segments),
            segment_offset=sum(len(segments[j::n]) for j in range(i)),
        )
    min_masks = max(config.mask_capacity, 1)
    if not share:  # fewer segments than processes: this one adds empty rows
        features: dict[str, np.dtype] = dict(RL_FEATURES)
        if table is not None:
            features[CONSTRAINT_ID] = np.dtype(np.int32)
            table = resolve_constraints([], table, min_masks, "pack_rl_batch")[1]
        empty = PackedBatch(
            **empty_batch(pad_rows(0, rows, multiple), row_len, features),
            constraint_masks=table,
            num_tasks=max(config.task_capacity, 1),
            num_segments=max(config.segment_capacity, 1),
        )
        return _with_routing(empty, routed)
    batch = pack_segments(
        share,
        row_len,
        min_rows=rows,
        rows_multiple=multiple,
        layout=config.layout,
        min_tasks=max(config.task_capacity, 1),
        min_segments=max(config.segment_capacity, 1),
        min_masks=min_masks,
        constraint_masks=table,
        **extra,
    )
    if batch.shape[0] > rows > 0:  # more rows than configured: rows x 2^k, few shapes
        unit = math.lcm(rows, multiple)
        batch = pad_batch_rows(batch, unit * pow2_bucket(-(-batch.shape[0] // unit)))
    return _with_routing(batch, routed)


def _with_routing(batch: PackedBatch, shape: tuple[int, int] | None) -> PackedBatch:
    """`batch` with a routing leaf when the global batch has one (a share whose own
    segments recorded none replays nothing: -1, each token routes itself)."""
    if shape is None or batch.routing is not None:
        return batch
    return dataclasses.replace(batch, routing=np.full((*batch.shape, *shape), -1, np.int32))
