"""Traces -> segments -> packed RL batch (`batching`): long segments, exclusions,
zero-advantage groups, row growth, process shares, grammar-constrained completions
(masks replayed with the real llguidance matcher and the tiny tokenizer)."""

import dataclasses

import numpy as np
import pytest

from ac2_jax.losses import aggregate_loss
from ac2_jax.segments import task_names
from ac2_jax.trace import Completion, Trace, TraceRecorder
from ac2_jax.training.rl.batching import batch_segments, build_batch, pack_rl_batch
from ac2_jax.training.rl.data import BatchConfig, informative_groups, select_traces
from ac2_jax.training.rl.metrics import batch_metrics
from tests.support.rl_traces import rl_trace as _trace


def _long_episode_trace(n_requests=5, n_out=6, prompt=8):
    """One append-only episode of `n_requests` requests (each re-sends all before it)."""
    t = Trace(task_id="long", attempt_id="0", group_id="g:long", reward=1.0, status="finished")
    rec, ids = TraceRecorder(t), list(range(1, prompt + 1))
    for k in range(n_requests):
        out = [100 + 10 * k + i for i in range(n_out)]
        rec.record("main", Completion(list(ids), out, [-0.1 * (k + 1)] * n_out))
        ids = ids + out + [50 + k, 51 + k]  # a tool result before the next request
    return t


def test_a_long_episode_keeps_every_agent_token_in_a_grown_row():
    """Packing used truncate=True: the last turns (the answer) silently left the loss."""
    t = _long_episode_trace()
    assert len(t.episodes) == 1 and len(t.episodes[0].token_ids) == 8 + 5 * 6 + 4 * 2  # 46
    batch, stats, _ = build_batch([t, _trace("long", 1, 0.0)], 0, BatchConfig(seq_len=16, rows=1))
    assert batch.shape[1] == stats.row_len == 64 and stats.long_segments == 1
    assert stats.truncated_agent_tokens == 0
    from_long = (batch.loss_mask > 0) & (batch.features["advantages"] > 0)
    assert from_long.sum() == t.num_agent_tokens == 30
    assert sorted(batch.targets[from_long].tolist()) == sorted(
        x for c in t.episodes[0].completions for x in c.output_ids)
    np.testing.assert_allclose(sorted(batch.features["sampler_logprobs"][from_long].tolist()),
                               sorted(-0.1 * (k + 1) for k in range(5) for _ in range(6)), rtol=1e-6)


def test_past_max_seq_len_the_end_is_cut_and_counted():
    t = _long_episode_trace()
    batch, stats, _ = build_batch([t], 0, BatchConfig(seq_len=16, max_seq_len=32, rows=1))
    # Tokens 32..45 leave the loss: the outputs of requests 4 (at 32..37) and 5 (40..45).
    assert stats.row_len == 32 and stats.truncated_segments == 1
    assert stats.truncated_agent_tokens == 12
    assert batch.loss_mask.sum() == t.num_agent_tokens - 12


def test_greedy_rollouts_are_refused_for_rl():
    t = _trace("a", 0, 1.0)
    t.episodes[0].completions[0].temperature = 0.0
    with pytest.raises(ValueError, match="temperature > 0"):
        build_batch([t, _trace("a", 1, 0.0)], 0, BatchConfig(seq_len=16))


def test_two_traces_with_one_key_are_refused():
    with pytest.raises(ValueError, match="share the key"):
        build_batch([_trace("a", 0, 1.0), _trace("a", 0, 0.0)], 0, BatchConfig(seq_len=16))


def test_sampling_params_reach_the_batch():
    t = _trace("a", 0, 1.0)
    c = t.episodes[0].completions[0]
    c.temperature, c.top_k, c.top_p = 0.3, 20, 0.9
    for layout in ("flat", "tree"):
        batch, _, _ = build_batch([t, _trace("a", 1, 0.0)], 0, BatchConfig(seq_len=16, layout=layout))
        first = (batch.loss_mask > 0) & (batch.features["advantages"] > 0)
        assert first.sum() == 3
        np.testing.assert_allclose(batch.temperature[first], 0.3, rtol=1e-6)
        assert (batch.top_k[first] == 20).all()
        np.testing.assert_allclose(batch.top_p[first], 0.9, rtol=1e-6)


def test_build_batch_shapes_and_advantages():
    traces = [_trace("a", i, float(i % 2), n_out=2 + i) for i in range(4)]
    batch, stats, adv = build_batch(traces, 0, BatchConfig(seq_len=16, rows=4))
    assert batch.shape == (4, 16) and stats.traces == 4
    assert batch.loss_mask.sum() == sum(2 + i for i in range(4))
    assert set(np.round(batch.features["advantages"][batch.loss_mask > 0], 6)) == {-0.5, 0.5}
    tree, _, _ = build_batch(traces, 0, BatchConfig(seq_len=64, rows=1, layout="tree"))
    assert tree.subtree_end is not None and tree.num_real_tokens < batch.num_real_tokens


def test_a_trace_left_alone_in_its_group_gets_advantage_0_and_is_counted():
    traces = [_trace("a", 0, 1.0), _trace("a", 1, 0.0, status="infra_error"), _trace("b", 0, 0.0),
              _trace("b", 1, 1.0)]
    batch, stats, adv = build_batch(traces, 0, BatchConfig(seq_len=16, rows=2))
    np.testing.assert_allclose(adv, [0.0, -0.5, 0.5])
    assert stats.lone_traces == 1 and stats.infra_errors == 1


def test_zero_advantage_groups_are_counted_and_left_out_on_request():
    """a: all solved, c: one kept trace (the other infra_error): no advantage.
    b: a reward spread. e: 0 and an agent_error, equal unless agent_error_reward differs."""
    traces = [_trace("a", 0, 1.0), _trace("a", 1, 1.0), _trace("b", 0, 1.0, n_out=4),
              _trace("b", 1, 0.0, n_out=5), _trace("c", 0, 0.0),
              _trace("c", 1, 1.0, status="infra_error"), _trace("e", 0, 0.0),
              _trace("e", 1, 0.0, status="agent_error")]
    kept, _, _ = select_traces(traces, 0, BatchConfig())
    assert informative_groups(kept) == {"g:b"}
    kept, _, _ = select_traces(traces, 0, BatchConfig(agent_error_reward=-1.0))
    assert informative_groups(kept) == {"g:b", "g:e"}  # the failure rules decide the reward

    config = BatchConfig(seq_len=16, rows=2)
    full, stats, _ = build_batch(traces, 0, config)
    assert stats.zero_advantage_groups == 3 and stats.dropped_zero_advantage == 0
    assert full.loss_mask.sum() == 3 + 3 + 4 + 5 + 3 + 3 + 3
    dropped, stats, adv = build_batch(traces, 0, dataclasses.replace(config,
                                                                     drop_zero_advantage=True))
    assert stats.zero_advantage_groups == 3 and stats.dropped_zero_advantage == 5
    assert stats.infra_errors == 1 and stats.traces == 8  # counters still see every trace
    np.testing.assert_allclose(adv, [0.5, -0.5])
    assert dropped.loss_mask.sum() == 4 + 5
    # b's tokens train with the same advantages either way (tolerance 1e-6).
    for batch in (full, dropped):
        got = sorted(np.round(batch.features["advantages"][batch.loss_mask > 0], 6).tolist())
        assert [a for a in got if a != 0.0] == [-0.5] * 5 + [0.5] * 4
    none, stats, _ = build_batch(traces[:2], 0, dataclasses.replace(config,
                                                                    drop_zero_advantage=True))
    assert none is None and stats.dropped_zero_advantage == 2


@pytest.mark.parametrize("layout", ["flat", "tree"])
def test_rows_past_the_config_grow_in_powers_of_two_of_it(layout):
    """The calculator demo compiled its RL step 4 times: rows followed the data (8, 9,
    10, 11...). Past `rows` they now grow to rows x 2^k (few geometries), and the
    padding rows carry nothing."""
    shapes, masks = set(), set()
    for n in range(3, 12):  # 3..11 traces of 10 tokens, one per 16-token row (no sharing)
        traces = [_trace(f"t{i}", i, float(i % 2), n_out=7) for i in range(n)]
        for k, t in enumerate(traces):  # distinct prompts: nothing for a tree to share
            t.episodes[0].token_ids[0] = 100 + k
        batch, _, _ = build_batch(traces, 0, BatchConfig(seq_len=16, rows=4, layout=layout))
        shapes.add(batch.shape)
        masks.add(float(batch.loss_mask.sum()))
        assert float(batch.loss_mask.sum()) == 7 * n
    assert shapes == {(4, 16), (8, 16), (16, 16)}, shapes


def _compacting_trace(task, attempt, reward, base=0, agents=("main", "compactor", "main")):
    """An attempt recorded as a compacting harness makes it: each agent's request starts
    a new episode (the compactor's transcript, then the main's restart from the memo)."""
    t = Trace(task_id=task, attempt_id=str(attempt), group_id=f"g:{task}", reward=reward,
              status="finished")
    rec = TraceRecorder(t)
    for k, agent in enumerate(agents):
        prompt = [1 + k, 2, 3 + base, 4]
        out = [1000 * (base + 1) + 20 * k + i for i in range(3 + k)]  # unique in a test
        rec.record(agent, Completion(prompt, out, [-0.1 * (k + 1)] * len(out)))
        if agent == "main":  # a tool result, then the same episode's next request
            rec.record(agent, Completion(prompt + out + [7, 8], [out[0] + 500, out[0] + 501],
                                         [-0.2, -0.3]))
    return t


def _only(trace, agents):
    return dataclasses.replace(trace, episodes=[e for e in trace.episodes if e.agent in agents])


@pytest.mark.parametrize("layout,mode,seq_len", [("flat", "episode", 32), ("tree", "episode", 32),
                                                 ("flat", "request", 32), ("flat", "episode", 8),
                                                 ("tree", "episode", 8), ("tree", "request", 32)])
def test_main_only_batch_is_the_batch_of_the_main_episodes(layout, mode, seq_len):
    """train_agents=("main",) builds exactly the batch of the traces stripped of their other
    episodes (every array equal), with the whole attempts' advantages; seq_len=8 makes the
    rows grow (episodes of 13-14 tokens)."""
    traces = [_compacting_trace("a", 0, 1.0), _compacting_trace("a", 1, 0.0, base=1),
              _compacting_trace("b", 0, 0.0, base=2, agents=("main", "compactor", "main",
                                                             "compactor", "main"))]
    config = BatchConfig(seq_len=seq_len, rows=2, layout=layout, segment_mode=mode)
    got, stats, adv = build_batch(traces, 0, dataclasses.replace(config, train_agents=("main",)))
    want, want_stats, want_adv = build_batch([_only(t, {"main"}) for t in traces], 0, config)
    np.testing.assert_array_equal(adv, want_adv)
    assert adv.tolist() == [0.5, -0.5, 0.0]
    for f in dataclasses.fields(want):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if isinstance(b, np.ndarray):
            np.testing.assert_array_equal(a, b, err_msg=f.name)
        elif f.name == "features":
            assert a.keys() == b.keys()
            for k in b:
                np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            assert a == b, f.name
    compactor = [e for t in traces for e in t.episodes if e.agent == "compactor"]
    assert stats.excluded_episodes == len(compactor) == 4
    assert stats.excluded_agent_tokens == sum(e.num_agent_tokens for e in compactor) > 0
    assert want_stats.excluded_episodes == want_stats.excluded_agent_tokens == 0
    if seq_len == 8:
        assert stats.row_len > 8 and stats.long_segments > 0 and stats.truncated_segments == 0
    everything, all_stats, _ = build_batch(traces, 0, config)  # None: the whole trace
    assert everything.loss_mask.sum() == sum(t.num_agent_tokens for t in traces)
    assert all_stats.excluded_episodes == 0


@pytest.mark.parametrize("layout", ["flat", "tree"])
def test_task_mean_is_the_token_mean_of_each_attempts_trained_episodes(layout):
    """loss(token) = 0.01 x its id: each task's loss must be the mean over the agent tokens
    of its trained episodes only, and the batch loss the mean over tasks that train (an
    attempt with no trained episode adds no task). fp32, rtol 1e-6."""
    traces = [_compacting_trace("a", 0, 1.0), _compacting_trace("a", 1, 0.0, base=1),
              _compacting_trace("a", 2, 0.0, base=2, agents=("compactor",))]
    for agents, names in ((("main",), {"main"}), (("compactor",), {"compactor"}),
                          (None, {"main", "compactor"})):
        batch, stats, _ = build_batch(traces, 0, BatchConfig(seq_len=32, rows=2, layout=layout,
                                                             train_agents=agents))
        per_token = 0.01 * batch.targets.astype(np.float32)
        means = []
        for t in traces:
            ids = [x for e in t.episodes if e.agent in names
                   for x, m in zip(e.token_ids, e.loss_mask) if m]
            if ids:
                means.append(np.mean(0.01 * np.asarray(ids, np.float64)))
        np.testing.assert_allclose(float(aggregate_loss(per_token, batch)), np.mean(means),
                                   rtol=1e-6)
        assert stats.excluded_episodes == sum(e.agent not in names for t in traces
                                              for e in t.episodes)


def test_subagent_wildcard_and_exact_labels_leave_out_their_episodes():
    """The labels `agent_trained` matches (tests/training/rl/test_rl_data.py) decide which episodes
    put tokens in the batch; the others are counted, and none of their tokens train."""
    traces = [_compacting_trace("a", 0, 1.0, agents=("main", "subagent:helper", "compactor",
                                                      "subagent:calc", "main")),
              _compacting_trace("a", 1, 0.0, base=1)]
    for agents, excluded in ((("main", "subagent:*"), {"compactor"}),
                             (("main", "subagent:calc"), {"compactor", "subagent:helper"}),
                             (("subagent:*", "compactor"), {"main"})):
        batch, stats, _ = build_batch(traces, 0, BatchConfig(seq_len=32, rows=2,
                                                             train_agents=agents))
        out = [e for t in traces for e in t.episodes if e.agent in excluded]
        assert stats.excluded_episodes == len(out)
        assert stats.excluded_agent_tokens == sum(e.num_agent_tokens for e in out)
        trained = set(batch.targets[batch.loss_mask > 0].tolist())
        for t in traces:
            for e in t.episodes:
                outs = {x for x, m in zip(e.token_ids, e.loss_mask) if m}
                assert (outs <= trained) if e.agent not in excluded else not (outs & trained)


def _branch_then_compact(choices):
    """main asks for n=2 (request r1; choice 1 continues), a compactor, then main restarts."""
    t = Trace(task_id="t", attempt_id="0", group_id="g", reward=1.0, status="finished",
              metadata={"artifacts": {"metrics": {"branch_choices": choices}}})
    rec = TraceRecorder(t)
    rec.record("main", Completion([1, 2, 3], [10], [-0.5], request_id="r1", choice_index=0))
    rec.record("main", Completion([1, 2, 3], [20], [-0.5], request_id="r1", choice_index=1))
    rec.record("compactor", Completion([9, 9], [60, 61], [-0.5, -0.5]))
    rec.record("main", Completion([5, 6], [40], [-0.5]))
    other = _compacting_trace("t", 1, 0.0)
    other.group_id = "g"
    return t, other


def test_train_agents_composes_with_unchosen_branches():
    """An unchosen response is counted as such (a response and its tokens), not as an
    excluded episode; the compactors left out by train_agents are."""
    t, other = _branch_then_compact([{"request_id": "r1", "index": 1}])
    batch, stats, _ = build_batch([t, other], 0, BatchConfig(seq_len=16, train_agents=("main",)))
    assert (stats.unchosen_responses, stats.unchosen_tokens) == (1, 1)
    assert stats.unknown_branch_groups == 0 and stats.excluded_episodes == 1 + 1
    assert stats.excluded_agent_tokens == 2 + other.episodes[1].num_agent_tokens
    trained = batch.targets[batch.loss_mask > 0].tolist()
    assert 10 not in trained and 60 not in trained and 20 in trained and 40 in trained


@pytest.mark.parametrize("choices", [None, [1], [{"request_id": "other", "index": 1}],
                                     [{"request_id": "r1", "index": 5}]])
def test_a_branch_group_whose_choice_is_unknown_trains_none_of_its_responses(choices):
    """No record, a bare index (older stores: which request?), another request's id, an
    index no response has: never a guess; the rest of the trace trains (counted)."""
    t, other = _branch_then_compact(choices)
    batch, stats, _ = build_batch([t, other], 0, BatchConfig(seq_len=16))
    assert (stats.unknown_branch_groups, stats.unknown_branch_tokens) == (1, 2)
    assert stats.unchosen_responses == 0
    trained = batch.targets[batch.loss_mask > 0].tolist()
    assert 10 not in trained and 20 not in trained and 60 in trained and 40 in trained


def test_process_shares_pack_the_one_process_batch():
    """pack_rl_batch with process_count=n: the shares hold every segment once, with the
    one-process batch's task ids and global segment numbers; rows are split among the
    processes; a process whose share is empty (fewer segments than processes) packs
    empty rows, not an error."""
    traces = [_trace("a", 0, 1.0), _trace("a", 1, 0.0), _trace("b", 0, 1.0, n_out=4)]
    config = BatchConfig(seq_len=16, rows=4, rows_multiple=4)
    segments, stats, _ = batch_segments(traces, 0, config)
    whole = pack_rl_batch(segments, stats.row_len, config)
    shares = [pack_rl_batch(segments, stats.row_len, config, process_index=i, process_count=2)
              for i in range(2)]
    assert [s.shape[0] for s in shares] == [2, 2] and whole.shape[0] == 4
    assert sum(float(s.loss_mask.sum()) for s in shares) == float(whole.loss_mask.sum()) == 10
    got = sorted((int(t), float(a)) for s in shares for t, a, m in zip(
        np.ravel(s.task_ids), np.ravel(s.features["advantages"]), np.ravel(s.loss_mask)) if m)
    want = sorted((int(t), float(a)) for t, a, m in zip(
        np.ravel(whole.task_ids), np.ravel(whole.features["advantages"]), np.ravel(whole.loss_mask)) if m)
    assert got == want
    numbers = [int(i) for s in shares for i in np.unique(s.segment_index[s.segment_ids > 0])]
    assert sorted(numbers) == [0, 1, 2]
    lone = pack_rl_batch(segments[:1], stats.row_len, config, process_index=1, process_count=2)
    assert lone.shape == (2, 16) and float(lone.loss_mask.sum()) == 0
    with pytest.raises(ValueError, match="layout='flat'"):
        pack_rl_batch(segments, stats.row_len, dataclasses.replace(config, layout="tree"),
                      process_index=0, process_count=2)


def test_a_greedy_episode_of_an_agent_left_out_is_not_checked():
    """Finding 5 (issue 32): check_sampled ran before the train_agents filter, so a
    greedy compactor under train_agents=("main",) made the whole trace raise."""
    t = _compacting_trace("t", 0, 1.0)
    for c in t.episodes[1].completions:  # the compactor's: decoded greedily
        c.temperature = 0.0
    other = _compacting_trace("t", 1, 0.0, base=1)
    for c in other.episodes[1].completions:
        c.temperature = 0.0
    batch, stats, _ = build_batch([t, other], 0, BatchConfig(seq_len=32, train_agents=("main",)))
    assert stats.excluded_episodes == 2 and batch.loss_mask.sum() == sum(
        e.num_agent_tokens for tr in (t, other) for e in tr.episodes if e.agent == "main")
    with pytest.raises(ValueError, match="temperature 0"):  # trained greedy tokens still raise
        build_batch([t, other], 0, BatchConfig(seq_len=32))


# -- grammar-constrained completions: their masks replayed (the sampler's tokenizer)

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["a", "b"],
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}
MODEL_V = 800  # the model's vocabulary: larger than the tiny tokenizer's 768


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
    return build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def _walk(grammar, tok, seed):
    """Output ids that follow `grammar` (random allowed tokens, then the end token)."""
    from ac2_jax.sampling.constraints import GrammarMatcher, end_token_id
    m, rng, out = GrammarMatcher(grammar, tok), np.random.default_rng(seed), []
    end = end_token_id(tok)
    while not out or out[-1] != end:
        allowed = np.flatnonzero(m.allowed())
        t = end if end in allowed and len(out) > 12 else int(rng.choice(allowed))
        m.consume(t)
        out.append(t)
    return out


def _tool_trace(tok, task, attempt, reward, free_first=True):
    """A free request, then a tool call sampled under the tool-call grammar."""
    from ac2_jax.sampling.constraints import tool_call_grammar
    grammar = tool_call_grammar(tok, [ADD])
    t = Trace(task_id=task, attempt_id=str(attempt), group_id=f"g:{task}", reward=reward,
              status="finished")
    rec, ids = TraceRecorder(t), [1, 2, 3]
    if free_first:
        rec.record("main", Completion(list(ids), [40, 41], [-0.5, -0.5]))
        ids = ids + [40, 41, 5]
    out = _walk(grammar, tok, seed=attempt)
    rec.record("main", Completion(list(ids), out, [-0.25] * len(out), constraint=grammar))
    return t, grammar, len(ids), out


@pytest.mark.parametrize("layout", ["flat", "tree"])
def test_constrained_completions_train_under_their_replayed_masks(tok, layout):
    """build_batch(tokenizer=): every trained token of a constrained completion has an id
    whose table row is replay_masks' row for it (over the model's vocabulary); free tokens
    have id 0; the table holds each distinct mask once, at least mask_capacity rows."""
    from ac2_jax.sampling.constraints import replay_masks
    from ac2_jax.segments import CONSTRAINT_ID, unpack_mask_bits
    (t0, grammar, n_p, out0), (t1, _, _, out1) = (_tool_trace(tok, "a", 0, 1.0),
                                                  _tool_trace(tok, "a", 1, 0.0))
    config = BatchConfig(seq_len=64, rows=2, layout=layout, mask_capacity=64)
    batch, stats, _ = build_batch([t0, t1], 0, config, tokenizer=tok, vocab_size=MODEL_V)
    table = unpack_mask_bits(batch.constraint_masks, MODEL_V)
    assert batch.constraint_masks.shape == (64, 25)  # ceil(800 / 32) words
    want = {}
    for out in (out0, out1):
        masks = replay_masks(grammar, tok, out, vocab_size=MODEL_V)
        ctx = [1, 2, 3, 40, 41, 5] + out
        for i, y in enumerate(out):
            want[(tuple(ctx[:n_p + i]), y)] = masks[i]
    ids = batch.features[CONSTRAINT_ID]
    counted = 0.0
    for r in range(batch.shape[0]):
        for p in np.flatnonzero(batch.loss_mask[r] > 0):
            k, y, path = ids[r, p], int(batch.targets[r, p]), _context(batch, r, p)
            if (path, y) not in want:  # the free request's tokens
                assert path in ((1, 2, 3), (1, 2, 3, 40)) and k == 0
                continue
            assert k > 0
            np.testing.assert_array_equal(table[k - 1], want[(path, y)])
            counted += batch.loss_mask[r, p]  # a merged tree node counts its paths
    assert counted == len(out0) + len(out1)
    assert len(np.unique(ids[ids > 0])) < len(out0) + len(out1)  # equal masks stored once
    # Counted in the step's metrics: the constrained trained tokens and distinct masks.
    assert stats.constrained_tokens == len(out0) + len(out1)
    assert stats.grammar_masks == len(np.unique(ids[ids > 0]))


def _context(batch, r, p):
    """The tokens a position sees (its ancestors in a tree row), in order, and itself."""
    toks, seg = batch.tokens[r], batch.segment_ids[r]
    if batch.subtree_end is None:
        start = np.flatnonzero(seg[: p + 1] != seg[p])
        start = start[-1] + 1 if len(start) else 0
        return tuple(int(x) for x in toks[start: p + 1])
    end = batch.subtree_end[r]
    return tuple(int(toks[j]) for j in range(p + 1) if end[j] >= p)


def test_constrained_completions_need_the_tokenizer(tok):
    t0, *_ = _tool_trace(tok, "a", 0, 1.0)
    t1, *_ = _tool_trace(tok, "a", 1, 0.0)
    with pytest.raises(ValueError, match=r"sampled under a\s+grammar.*pass tokenizer="):
        build_batch([t0, t1], 0, BatchConfig(seq_len=64))


def test_free_batches_are_packed_as_before_and_shares_carry_one_table(tok):
    """No constrained token: no table, no feature. Process shares of a constrained batch
    each carry the whole batch's table and ids (one global numbering), also an empty one."""
    from ac2_jax.segments import CONSTRAINT_ID
    free, _, _ = build_batch([_trace("a", 0, 1.0), _trace("a", 1, 0.0)], 0,
                             BatchConfig(seq_len=16), tokenizer=tok)
    assert free.constraint_masks is None and CONSTRAINT_ID not in free.features
    traces = [_tool_trace(tok, "a", i, float(i % 2), free_first=bool(i % 2))[0] for i in range(3)]
    config = BatchConfig(seq_len=64, rows=4, rows_multiple=4)
    segments, stats, _ = batch_segments(traces, 0, config, tokenizer=tok)
    whole = pack_rl_batch(segments, stats.row_len, config)
    shares = [pack_rl_batch(segments, stats.row_len, config, process_index=i, process_count=2)
              for i in range(2)]
    for s in shares:
        np.testing.assert_array_equal(s.constraint_masks, whole.constraint_masks)
    got = sorted(int(k) for s in shares for k in s.features[CONSTRAINT_ID][s.loss_mask > 0])
    assert got == sorted(int(k) for k in whole.features[CONSTRAINT_ID][whole.loss_mask > 0])
    lone = pack_rl_batch(segments[:1], stats.row_len, config, process_index=1, process_count=2)
    assert lone.constraint_masks.shape == whole.constraint_masks.shape
    assert CONSTRAINT_ID in lone.features and float(lone.loss_mask.sum()) == 0


@pytest.mark.parametrize("layout", ["flat", "tree"])
def test_mean_over_problems_weighs_every_problem_the_same(layout):
    """Issue 61, finding 6: task_mean weighs every attempt (trace) the same, so a problem
    with 8 attempts weighs 4x one with 2. mean_over="problem" averages a group's attempts
    first, then the groups, keeping the staleness weights: with a per-token loss c_k on
    every trained token of attempt k (weight w_k), the batch loss is mean_g mean_{k in g}
    w_k c_k (mean_k w_k c_k per attempt). fp32 against float64 numpy, rtol 1e-5."""
    traces = ([_trace("a", i, float(i % 2), version=2, n_out=2 + i % 3) for i in range(8)]
              + [_trace("b", i, float(i), version=2, n_out=4) for i in range(2)]
              + [_trace("c", i, 0.5 * i, version=0, n_out=3) for i in range(3)])  # lag 2
    c = {t.key: v for t, v in zip(traces, np.random.default_rng(0).normal(size=len(traces)))}
    want, got = {}, {}
    for mean_over in ("attempt", "problem"):
        cfg = BatchConfig(seq_len=32, rows=4, layout=layout, stale="downweight",
                          mean_over=mean_over)
        segs, stats, _ = batch_segments(traces, 2, cfg)
        assert stats.downweighted == 3
        batch = pack_rl_batch(segs, stats.row_len, cfg)
        names = np.array(task_names(segs))
        per_token = np.where(batch.loss_mask > 0,
                             np.vectorize(c.get)(names[batch.task_ids]), 0.0).astype(np.float32)
        got[mean_over] = float(aggregate_loss(per_token, batch, "task_mean"))
        w = {t.key: (0.5 if t.task_id == "c" else 1.0) for t in traces}
        attempt = {t.key: w[t.key] * c[t.key] for t in traces}
        groups = {}
        for t in traces:
            groups.setdefault(t.group_id, []).append(attempt[t.key])
        want[mean_over] = (np.mean(list(attempt.values())) if mean_over == "attempt"
                           else np.mean([np.mean(v) for v in groups.values()]))
        np.testing.assert_allclose(got[mean_over], want[mean_over], rtol=1e-5)
    assert not np.isclose(want["attempt"], want["problem"])


def test_mean_over_is_checked():
    with pytest.raises(ValueError, match="mean_over"):
        BatchConfig(mean_over="task")
    from ac2_jax.training import PolicyGradientLoss
    from ac2_jax.training.rl.trainer import RLConfig
    with pytest.raises(ValueError, match="mean_over.*task_mean"):
        RLConfig(batch=BatchConfig(mean_over="problem"), loss=PolicyGradientLoss(mode="token_mean"))


def test_an_agent_token_at_position_0_is_counted_as_unpredicted():
    """A segment that starts with an agent token (no prompt before it): nothing predicts
    that token, so neither the loss nor its normaliser holds it. RL counted fit_segments'
    cuts but not this, so the token left the loss silently (issue 61)."""
    t = Trace(task_id="p0", attempt_id="0", group_id="g:p0", reward=1.0, status="finished")
    TraceRecorder(t).record("main", Completion([], [10, 11, 12], [-0.5] * 3))
    batch, stats, _ = build_batch([t, _trace("p0", 1, 0.0)], 0, BatchConfig(seq_len=16))
    assert stats.unpredicted_agent_tokens == 1
    assert batch.loss_mask.sum() == t.num_agent_tokens - 1 + 3
    assert batch_metrics(stats)["unpredicted_agent_tokens"] == 1.0
    _, stats, _ = build_batch([_trace("a", 0, 1.0), _trace("a", 1, 0.0)], 0,
                              BatchConfig(seq_len=16))
    assert stats.unpredicted_agent_tokens == 0


def test_per_token_staleness_keeps_trained_tokens_no_completion_versions():
    """stale_unit="token" drops the stale tokens a completion sampled (its per-token
    versions); a trained token that no completion records (an episode built without
    completions: POLICY_VERSION -1) has no version and is never stale, as
    select_traces judges such a trace. It was dropped as lagging learner + 1 (issue
    65 review)."""
    from ac2_jax.trace import Episode

    def mixed(attempt, reward):  # one generation spanning versions 0 -> 3
        t = Trace(task_id="a", attempt_id=str(attempt), group_id="g:a", reward=reward,
                  status="finished")
        TraceRecorder(t).record("main", Completion([1, 2, 3], [10, 11, 12], [-0.5] * 3,
                                                   output_versions=[0, 3, 3]))
        return t

    bare = [Trace(task_id="b", attempt_id=str(i), group_id="g:b", reward=float(i),
                  status="finished", episodes=[Episode("main", [1, 2, 3, 10, 11],
                                                       [0, 0, 0, 1, 1], [0, 0, 0, -0.5, -0.5])])
            for i in range(2)]
    cfg = BatchConfig(seq_len=16, rows=2, max_staleness=1, stale_unit="token")
    batch, stats, _ = build_batch([mixed(0, 0.0), mixed(1, 1.0), *bare], 3, cfg)
    assert stats.dropped_stale == 0 and stats.dropped_stale_tokens == 2  # the version-0 ones
    assert batch.loss_mask.sum() == 2 * 2 + 2 * 2
