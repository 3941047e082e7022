"""Shared-prefix tree packing: structure, weights, and loss equal to flat packing."""

import numpy as np
import pytest

from ac2_jax.losses import aggregate_loss, tree_attention_mask
from ac2_jax.segments import Segment, pack_mask_bits, pack_segments
from tests.support.rl_like_segments import rl_like_segment


def group_segments(n_attempts=4, prompt_len=12, resp_len=5, seed=0):
    """A GRPO-like group: one shared prompt, n sampled responses, one task each."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(1, 40, prompt_len).tolist()
    segs = []
    for a in range(n_attempts):
        resp = [41 + a] + rng.integers(1, 40, resp_len - 1).tolist()
        lp = (-rng.random(resp_len)).tolist()
        segs.append(rl_like_segment(prompt + resp, [0] * prompt_len + [1] * resp_len,
                            [0.0] * prompt_len + lp, task=f"t/{a}", advantage=float(a) - 1.5))
    return segs


def fork_segments(seed=1):
    """Multi-response fork: a shared history with an earlier agent turn, then 3 branches."""
    rng = np.random.default_rng(seed)
    hist = rng.integers(1, 40, 10).tolist()
    hist_mask = [0] * 4 + [1] * 3 + [0] * 3
    hist_lp = [0.0] * 4 + [-0.3, -0.2, -0.1] + [0.0] * 3
    segs = []
    for _b in range(3):
        resp = rng.integers(1, 40, 4).tolist()
        segs.append(rl_like_segment(hist + resp, hist_mask + [1] * 4, hist_lp + (-rng.random(4)).tolist(),
                            task="fork/0", advantage=0.5))
    return segs


def path_rows(batch, tokens, loss_mask=None):
    """(row, indices) of `tokens`' path in a tree batch (depth-first search)."""
    def children(r, parent, d):
        lo = 0 if parent is None else parent + 1
        hi = batch.shape[1] - 1 if parent is None else batch.subtree_end[r, parent]
        nxt = tokens[d + 1] if d + 1 < len(tokens) else 0
        return [c for c in range(lo, hi + 1)
                if batch.segment_ids[r, c] > 0 and batch.positions[r, c] == d
                and batch.tokens[r, c] == tokens[d] and batch.targets[r, c] == nxt
                and (loss_mask is None or d + 1 >= len(tokens)
                     or (batch.loss_mask[r, c] > 0) == (loss_mask[d + 1] > 0))]

    def search(r, parent, d):
        if d == len(tokens):
            return []
        for c in children(r, parent, d):
            rest = search(r, c, d + 1)
            if rest is not None:
                return [c] + rest
        return None

    for r in range(batch.shape[0]):
        found = search(r, None, 0)
        if found is not None:
            return r, found
    raise AssertionError("path not found in tree batch")


def fake_per_token(batch):
    # Depends only on (token, target, position): equal in both layouts.
    return np.cos(batch.tokens * 0.3 + batch.targets * 0.7 + batch.positions * 0.05).astype(np.float32)


@pytest.mark.parametrize("make", [group_segments, fork_segments])
def test_tree_loss_equals_flat(make):
    segs = make()
    flat = pack_segments(segs, seq_len=64)
    tree = pack_segments(segs, seq_len=64, layout="tree")
    assert tree.num_real_tokens < flat.num_real_tokens
    assert tree.loss_mask.sum() == pytest.approx(flat.loss_mask.sum())
    for mode in ("task_mean", "token_mean", "constant"):
        a = float(aggregate_loss(fake_per_token(flat), flat, mode, normalizer=50.0))
        b = float(aggregate_loss(fake_per_token(tree), tree, mode, normalizer=50.0))
        assert b == pytest.approx(a, rel=1e-6), mode


def test_group_layout_shares_the_prompt_once():
    segs = group_segments(n_attempts=8, prompt_len=20, resp_len=6)
    tree = pack_segments(segs, seq_len=128, layout="tree")
    # 19 shared prompt tokens + per attempt: its copy of the last prompt token
    # (it predicts a different first response token) + 6 response tokens.
    assert tree.num_real_tokens == 19 + 8 * 7
    for s in segs:
        r, idx = path_rows(tree, s.tokens.tolist(), s.loss_mask)
        mask = np.asarray(tree_attention_mask(tree.subtree_end[r], tree.segment_ids[r]))
        last = idx[-1]
        assert sorted(np.nonzero(mask[last])[0].tolist()) == sorted(idx)
        np.testing.assert_allclose(tree.loss_mask[r, idx[:-1]], s.loss_mask[1:])
        np.testing.assert_allclose(tree.features["sampler_logprobs"][r, idx[:-1]],
                                   s.features["sampler_logprobs"][1:])
        np.testing.assert_allclose(tree.features["advantages"][r, idx[:-1]][s.loss_mask[1:] > 0],
                                   s.features["advantages"][0])


def test_shared_agent_tokens_sum_their_weights():
    segs = fork_segments()
    tree = pack_segments(segs, seq_len=64, layout="tree")
    r, idx = path_rows(tree, segs[0].tokens.tolist())
    # The history's agent tokens (targets at indices 3..5) are shared by 3 branches.
    np.testing.assert_allclose(tree.loss_mask[r, idx[3:6]], 3.0)


def test_rows_split_when_full_and_errors():
    segs = group_segments(n_attempts=6, prompt_len=10, resp_len=5)
    tree = pack_segments(segs, seq_len=25, layout="tree", rows_multiple=4)
    assert tree.shape == (4, 25)
    assert tree.loss_mask.sum() == pytest.approx(6 * 5)
    with pytest.raises(ValueError, match="segment_mean"):
        aggregate_loss(fake_per_token(tree), tree, "segment_mean")
    with pytest.raises(ValueError, match="seq_len=8"):
        pack_segments(segs, seq_len=8, layout="tree")


# -- with the real model: log-probs, loss and gradients equal flat packing ----

def _model():
    import jax.numpy as jnp
    from flax import nnx

    from ac2_jax.models import Decoder, DecoderConfig
    cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, dtype=jnp.float32)
    return Decoder(cfg, rngs=nnx.Rngs(0))


def _pg_loss_fn(graphdef, batch):
    import jax
    from flax import nnx

    from ac2_jax.losses import policy_gradient_loss, token_logprobs

    def loss(params):
        model = nnx.merge(graphdef, params)
        logits = model(batch.tokens, batch.positions, batch.segment_ids, batch.subtree_end)
        lp = token_logprobs(logits, batch.targets)
        per_tok = policy_gradient_loss(lp, jax.lax.stop_gradient(lp),
                                       batch.features["sampler_logprobs"],
                                       batch.features["advantages"], batch.loss_mask, tis_cap=2.0)
        return aggregate_loss(per_tok, batch, "task_mean")
    return loss


@pytest.mark.parametrize("make", [group_segments, fork_segments])
def test_model_logprobs_loss_and_grads_equal_flat(make):
    import jax
    from flax import nnx

    from ac2_jax.losses import token_logprobs
    model = _model()
    segs = make()
    flat = pack_segments(segs, seq_len=24)
    tree = pack_segments(segs, seq_len=64, layout="tree")
    graphdef, params = nnx.split(model, nnx.Param)

    @jax.jit
    def logprobs(params, b):
        logits = nnx.merge(graphdef, params)(b.tokens, b.positions, b.segment_ids, b.subtree_end)
        return token_logprobs(logits, b.targets)

    lp_flat = np.asarray(logprobs(params, flat))
    lp_tree = np.asarray(logprobs(params, tree))
    for i, s in enumerate(segs):
        r_t, idx_t = path_rows(tree, s.tokens.tolist(), s.loss_mask)
        r_f = int(np.nonzero((flat.segment_index == i) & (flat.segment_ids > 0))[0][0])
        cols = np.nonzero((flat.segment_index[r_f] == i) & (flat.segment_ids[r_f] > 0))[0]
        # Every token's log-prob of its next token, along the whole path (fp32, 1e-5).
        np.testing.assert_allclose(lp_tree[r_t, idx_t[:-1]], lp_flat[r_f, cols[:-1]], atol=1e-5)

    l_flat, g_flat = jax.jit(jax.value_and_grad(_pg_loss_fn(graphdef, flat)))(params)
    l_tree, g_tree = jax.jit(jax.value_and_grad(_pg_loss_fn(graphdef, tree)))(params)
    np.testing.assert_allclose(float(l_tree), float(l_flat), rtol=1e-5)
    gf, gt = jax.tree.leaves(g_flat), jax.tree.leaves(g_tree)
    for a, b in zip(gf, gt):
        a, b = np.asarray(a), np.asarray(b)
        # Relative to the gradient's scale (fp32, 1e-5).
        assert np.max(np.abs(a - b)) <= 1e-5 * max(np.max(np.abs(a)), 1e-8)



def test_features_in_another_dict_order_land_under_their_names():
    """Segments whose features were added in different orders (e.g. a grammar mask id
    before the advantages on one, after on another) pack each value under its own name,
    as the flat layout does (the trie keys used each segment's own dict order)."""
    m = np.zeros((1, 40), bool)
    m[0, 5] = True
    a = Segment([1, 2, 3], [0, 1, 1], task="a", features={"sampler_logprobs": [0, -.1, -.2]}
                ).with_features(advantages=np.full(3, .5, np.float32))
    b = Segment([7, 8, 5], [0, 1, 1], task="b", features={"sampler_logprobs": [0, -.3, -.4]}
                ).with_constraints(np.array([0, 0, 1], np.int32), pack_mask_bits(m)
                                   ).with_features(advantages=np.full(3, .7, np.float32))
    assert list(b.features) == ["sampler_logprobs", "constraint_id", "advantages"]
    tree, flat = (pack_segments([a, b], 16, layout=lay) for lay in ("tree", "flat"))
    for name in flat.features:
        np.testing.assert_array_equal(tree.features[name][0, :6], flat.features[name][0, :6])
    np.testing.assert_allclose(tree.features["advantages"][0, :6], [.5, .5, 0, .7, .7, 0], atol=1e-7)
