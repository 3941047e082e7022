"""RL features: advantages and sampler log-probs ride in PackedBatch.features."""

import numpy as np
import pytest

from ac2_jax.segments import SAMPLER_LOGPROBS, Segment, pack_segments
from ac2_jax.training.core.objectives import PolicyGradientLoss
from ac2_jax.training.rl import (
    ADVANTAGES,
    RL_FEATURES,
    BatchConfig,
    carries_signal,
    pack_rl_batch,
    rl_segment,
    with_advantage,
)


def test_rl_segment_carries_both_features_on_every_token():
    s = rl_segment([1, 2, 3, 4], [0, 0, 1, 1], [0, 0, -0.5, -0.25], task="t", advantage=0.5)
    assert set(s.features) == set(RL_FEATURES)
    np.testing.assert_array_equal(s.features[ADVANTAGES], [0.5] * 4)
    np.testing.assert_allclose(s.features[SAMPLER_LOGPROBS], [0, 0, -0.5, -0.25])
    assert carries_signal(s)
    assert not carries_signal(with_advantage(s, 0.0))
    assert not carries_signal(Segment([1, 2], [0, 1], task="t"))  # no advantages at all
    # the advantage sits on context tokens too, but only trained ones count
    assert not carries_signal(rl_segment([1, 2], [0, 0], [0, 0], task="t", advantage=1.0))


def test_packed_rl_batch_aligns_features_with_targets():
    s = rl_segment([1, 2, 3, 4], [0, 0, 1, 1], [0, 0, -0.5, -0.25], task="t", advantage=0.5)
    b = pack_segments([s], seq_len=6)
    m = b.loss_mask[0] > 0
    np.testing.assert_array_equal(b.targets[0][m], [3, 4])
    np.testing.assert_allclose(b.features[SAMPLER_LOGPROBS][0][m], [-0.5, -0.25])
    np.testing.assert_array_equal(b.features[ADVANTAGES][0][m], [0.5, 0.5])


def test_an_empty_process_share_has_the_rl_features():
    """Fewer segments than processes: the empty share's pytree matches the others'."""
    s = rl_segment([1, 2, 3], [0, 1, 1], [0, -0.1, -0.1], task="t", advantage=1.0)
    config = BatchConfig(seq_len=8, rows=2, layout="flat")
    full = pack_rl_batch([s], 8, config, process_index=0, process_count=2)
    empty = pack_rl_batch([s], 8, config, process_index=1, process_count=2)
    assert set(empty.features) == set(full.features) == set(RL_FEATURES)
    assert {k: v.dtype for k, v in empty.features.items()} == RL_FEATURES


def test_the_policy_gradient_loss_names_a_missing_feature():
    import jax.numpy as jnp

    b = pack_segments([Segment([1, 2, 3], [0, 1, 1], task="t")], seq_len=4)
    logits = jnp.zeros((*b.shape, 8))
    with pytest.raises(KeyError, match="no feature 'sampler_logprobs'"):
        PolicyGradientLoss()(logits, b)
