"""TraceRecorder: completions -> append-only episodes."""

import json

import pytest

from ac2_jax.trace import Completion, Trace, TraceRecorder


def _c(prompt, output, lp=None):
    lp = lp if lp is not None else [-0.1 * (i + 1) for i in range(len(output))]
    return Completion(prompt_ids=list(prompt), output_ids=list(output), output_logprobs=lp)


def test_three_turn_tool_conversation_is_one_episode():
    rec = TraceRecorder(Trace(task_id="t"))
    sys_user = [1, 2, 3, 4]
    out1 = [10, 11, 12]            # assistant: tool call
    tool1 = [20, 21]               # tool result
    out2 = [13, 14]                # assistant: second tool call
    tool2 = [22]
    out3 = [15, 16, 17, 18]        # assistant: answer
    rec.record("main", _c(sys_user, out1))
    rec.record("main", _c(sys_user + out1 + tool1, out2))
    rec.record("main", _c(sys_user + out1 + tool1 + out2 + tool2, out3))
    eps = rec.trace.episodes
    assert len(eps) == 1
    ep = eps[0]
    assert ep.token_ids == sys_user + out1 + tool1 + out2 + tool2 + out3
    expected_mask = [0] * 4 + [1] * 3 + [0] * 2 + [1] * 2 + [0] + [1] * 4
    assert ep.loss_mask == expected_mask
    # Sampler log-probs sit exactly on the outputs, 0 elsewhere.
    assert [lp != 0.0 for lp in ep.sampler_logprobs] == [bool(m) for m in expected_mask]
    assert len(ep.completions) == 3


def test_rewritten_history_starts_new_episode():
    rec = TraceRecorder(Trace(task_id="t"))
    rec.record("main", _c([1, 2, 3], [4, 5]))
    rec.record("main", _c([1, 2, 3, 4, 5, 6], [7]))
    # Compaction: the history is replaced by a summary.
    rec.record("main", _c([1, 2, 99, 98], [8, 9]))
    eps = rec.trace.episodes
    assert len(eps) == 2
    assert eps[1].token_ids == [1, 2, 99, 98, 8, 9]
    assert eps[1].loss_mask == [0, 0, 0, 0, 1, 1]


def test_two_agents_get_separate_episodes():
    rec = TraceRecorder(Trace(task_id="t"))
    rec.record("main", _c([1, 2], [3]))
    rec.record("compactor", _c([1, 2, 3], [4]))   # extends main's tokens, other agent
    rec.record("main", _c([1, 2, 3, 5], [6]))
    agents = [e.agent for e in rec.trace.episodes]
    assert agents == ["main", "compactor"]
    assert rec.trace.episodes[0].token_ids == [1, 2, 3, 5, 6]
    assert rec.trace.episodes[1].token_ids == [1, 2, 3, 4]


def test_second_response_to_same_prompt_branches():
    rec = TraceRecorder(Trace(task_id="t"))
    rec.record("main", _c([1, 2], [3]))
    rec.record("main", _c([1, 2], [4]))           # n=2: a second branch
    rec.record("main", _c([1, 2, 4, 7], [8]))     # continues branch 2
    eps = rec.trace.episodes
    assert [e.token_ids for e in eps] == [[1, 2, 3], [1, 2, 4, 7, 8]]


def _conversation(turns: int, delta: bool) -> Trace:
    """`turns` user/assistant turns of one agent, each request carrying the whole list."""
    rec = TraceRecorder(Trace(task_id="t"), delta_messages=delta)
    messages, tokens = [{"role": "system", "content": "s" * 200}], [1, 2, 3]
    for i in range(turns):
        messages = messages + [{"role": "user", "content": f"question {i} " + "q" * 200}]
        prompt = tokens + [4, 5]
        rec.record("main", Completion(prompt, [6, 7], [-0.1, -0.2], messages=list(messages)))
        tokens = prompt + [6, 7]
        messages = messages + [{"role": "assistant", "content": f"answer {i}"}]
    return rec.trace


def test_delta_messages_rebuild_every_request_and_grow_linearly():
    full, delta = _conversation(20, delta=False), _conversation(20, delta=True)
    (ep,) = delta.episodes
    assert ep.messages_at() == [c.messages for c in full.episodes[0].completions]
    assert all(c.messages is None and len(c.messages_delta) <= 2 for c in ep.completions[1:])
    # Round trip through JSON keeps the deltas and the rebuilt lists.
    back = Trace.from_dict(json.loads(json.dumps(delta.to_dict())))
    assert back.episodes[0].messages_at() == ep.messages_at()
    assert [c.messages for c in back.episodes[0].with_messages()] == ep.messages_at()

    def size(turns, d):
        return len(json.dumps(_conversation(turns, d).to_dict()))

    # Linear: turns 10..20 add as much as turns 0..10 (plus small token-list growth),
    # while full lists on every completion grow quadratically.
    grow_delta = size(20, True) - size(10, True)
    assert grow_delta < 1.3 * (size(10, True) - size(0, True))
    assert size(20, False) - size(10, False) > 2 * (size(10, False) - size(0, False))


def test_a_request_that_rewrites_history_stores_its_whole_list():
    rec = TraceRecorder(Trace(task_id="t"), delta_messages=True)
    a = [{"role": "user", "content": "a"}]
    rec.record("main", Completion([1], [2], [-0.1], messages=a))
    b = [{"role": "user", "content": "edited"}]
    rec.record("main", Completion([1, 2, 3], [4], [-0.1], messages=b))  # same episode
    (ep,) = rec.trace.episodes
    assert ep.completions[1].messages_start == 0 and ep.completions[1].messages_delta == b
    assert ep.messages_at() == [a, b]
    ep.completions[1].messages_delta = [{"role": "user", "content": "tampered"}]
    with pytest.raises(ValueError, match="fingerprint"):
        ep.messages_at()
