"""Per-turn credit (issue 64): returns-to-go from the env's per-turn rewards or the final
reward discounted over turns, advantages per (problem, agent, turn), carried per token by
each request's output; the normaliser unchanged; counted; bad input named."""

import numpy as np
import pytest

from ac2_jax.trace import Completion, Trace, TraceRecorder
from ac2_jax.training import BatchConfig
from ac2_jax.training.rl import ADVANTAGES, RLOOAdvantage, batch_segments, pack_rl_batch
from ac2_jax.training.rl.credit import turn_returns


def two_turns(attempt, reward, turn_rewards=None, task="t"):
    """Turn 0 samples 2 tokens, turn 1 samples 3 (append-only, one episode)."""
    t = Trace(task_id=task, attempt_id=str(attempt), group_id=f"g:{task}", reward=reward,
              status="finished")
    rec = TraceRecorder(t)
    rec.record("main", Completion([1, 2, 3], [10, 11], [-0.5] * 2))
    rec.record("main", Completion([1, 2, 3, 10, 11, 4], [12, 13, 14], [-0.5] * 3))
    if turn_rewards is not None:
        t.metadata["turn_rewards"] = [list(turn_rewards)]
    return t


def token_advantages(segments):
    """Per segment: the advantages of its trained tokens, in order."""
    return [np.asarray(s.features[ADVANTAGES])[np.asarray(s.loss_mask) > 0].tolist()
            for s in segments]


def test_returns_to_go():
    """G_k = sum_{k' >= k} gamma^(k' - k) r_k' (turn rewards); gamma^(K-1-k) R (discount)."""
    t = two_turns(0, 1.0, [0.25, 1.0])
    np.testing.assert_allclose(turn_returns(t, "turn", 0.5)[0][0], [0.25 + 0.5, 1.0])
    np.testing.assert_allclose(turn_returns(t, "discount", 0.5)[0][0], [0.5, 1.0])
    assert turn_returns(t, "turn", 1.0)[1] and not turn_returns(t, "discount", 1.0)[1]


@pytest.mark.parametrize("mode", ["episode", "request"])
def test_turn_rewards_give_each_turn_its_advantage(mode):
    """Turn 0 decides (rewards 1 / 0), turn 1 gets 0 in both: turn 0's tokens carry
    +-0.5, turn 1's carry 0 (a tied turn), in either segment mode."""
    ts = [two_turns(0, 1.0, [1.0, 0.0]), two_turns(1, 0.0, [0.0, 0.0])]
    cfg = BatchConfig(seq_len=32, rows=4, credit="turn", segment_mode=mode)
    segs, stats, _ = batch_segments(ts, 0, cfg)
    got = [x for xs in token_advantages(segs) for x in xs]
    assert got == [0.5, 0.5, 0.0, 0.0, 0.0, -0.5, -0.5, 0.0, 0.0, 0.0]
    assert stats.turn_credit_traces == 2 and stats.final_credit_traces == 0
    # the normaliser is unchanged: every trained token still counts in its attempt
    batch = pack_rl_batch(segs, stats.row_len, cfg)
    assert float(np.asarray(batch.loss_mask).sum()) == 10


def test_final_reward_alone_and_discounted():
    ts = [two_turns(0, 1.0), two_turns(1, 0.0), two_turns(2, 0.0)]
    segs, _, _ = batch_segments(ts, 0, BatchConfig(seq_len=32, rows=4))  # today's credit
    np.testing.assert_allclose(token_advantages(segs)[0], [2 / 3] * 5, rtol=1e-7)
    cfg = BatchConfig(seq_len=32, rows=4, credit="discount", gamma=0.5,
                      advantage=RLOOAdvantage())
    segs, stats, _ = batch_segments(ts, 0, cfg)
    # RLOO per turn over returns [0.5, 0, 0] (turn 0) and [1, 0, 0] (turn 1)
    np.testing.assert_allclose(token_advantages(segs)[0], [0.5] * 2 + [1.0] * 3)
    np.testing.assert_allclose(token_advantages(segs)[1], [-0.25] * 2 + [-0.5] * 3)
    assert stats.final_credit_traces == 3


def test_a_trace_without_turn_rewards_falls_back_and_bad_ones_are_named():
    ts = [two_turns(0, 1.0, [1.0, 0.0]), two_turns(1, 0.0)]
    _, stats, _ = batch_segments(ts, 0, BatchConfig(seq_len=32, rows=4, credit="turn"))
    assert (stats.turn_credit_traces, stats.final_credit_traces) == (1, 1)
    with pytest.raises(ValueError, match="one reward per completion"):
        batch_segments([two_turns(0, 1.0, [1.0])], 0, BatchConfig(seq_len=32, credit="turn"))
    with pytest.raises(ValueError, match="credit must be one of"):
        BatchConfig(credit="step")
    with pytest.raises(ValueError, match="gamma"):
        BatchConfig(credit="discount", gamma=0.0)


def test_gamma_without_turn_credit_is_refused():
    """gamma discounts over turns: with credit='trace' it would be ignored, so it is named."""
    with pytest.raises(ValueError, match="gamma=0.9.*credit='trace'"):
        BatchConfig(gamma=0.9)


def test_overlong_shaping_reaches_per_turn_rewards():
    """DAPO's overlong penalty (eq. 13) changes the attempt's reward; with the env's per-turn
    rewards it is added to each episode's last turn (as the final reward sits there under
    'discount' and the fallback), never counted and then dropped. 5 sampled tokens, soft
    limit 4, cache 2: p = (4 - 5) / 2 = -0.5. REINFORCE (no baseline) shows the returns."""
    from ac2_jax.training.rl import OverlongShaping, ReinforceAdvantage

    ts = [two_turns(0, 1.0, [1.0, 0.0]), two_turns(1, 0.0, [0.0, 0.0])]
    cfg = BatchConfig(seq_len=32, rows=4, credit="turn", advantage=ReinforceAdvantage(),
                      overlong=OverlongShaping(max_tokens=6, cache=2))
    segs, stats, _ = batch_segments(ts, 0, cfg)
    assert stats.overlong_shaped == 2 and stats.overlong_penalty == -1.0
    np.testing.assert_allclose(token_advantages(segs)[0], [0.5] * 2 + [-0.5] * 3)
    np.testing.assert_allclose(token_advantages(segs)[1], [-0.5] * 5)


def test_a_non_finite_turn_reward_is_named():
    t = two_turns(0, 1.0, [float("nan"), 1.0])
    with pytest.raises(ValueError, match="finite"):
        batch_segments([t], 0, BatchConfig(seq_len=32, credit="turn"))
