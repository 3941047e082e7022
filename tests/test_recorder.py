"""TraceRecorder: completions -> append-only episodes."""

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
