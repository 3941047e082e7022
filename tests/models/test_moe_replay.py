"""Routing replay (R3) on the MoE decoder: the learner uses the experts the sampler chose.

The sampler decodes (prefill through the KV cache) and records each token's
experts per MoE layer (`decode(return_routing=True)`); the learner's packed
forward takes them (`routing=`). Its own router differs from the sampler's
by a small perturbation (std 1e-3 against weights of std 0.1) that flips
some top-k choices: without replay the learner's log-probs of those tokens
differ from the sampler's by up to ~1e-1, with replay only by the
perturbation's effect on the gate weights.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ac2_jax.models.family import build_model
from ac2_jax.models.moe import MoEDecoderConfig

B, L = 4, 40
CONFIG = MoEDecoderConfig.tiny(
    num_layers=3, mlp_only_layers=(0,), norm_topk_prob=True, initializer_range=0.1,
    scan_layers=False, remat="none",
)  # fmt: skip


def token_logprobs(logits, tokens):
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)[:, :-1]
    return np.asarray(jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0])


@nnx.jit
def sample(model, tokens, positions):
    """The sampler's view: prefill through the cache, routing recorded."""
    logits, _, routed = model.decode(
        tokens, positions, model.init_cache(*tokens.shape), return_routing=True
    )
    return logits, routed


@nnx.jit
def learn(model, tokens, positions, routing=None):
    h, stats = model.forward_with_router(tokens, positions, jnp.ones_like(tokens), routing=routing)
    return model.logits(h), stats.experts


@pytest.fixture(scope="module")
def run():
    learner = build_model(CONFIG, nnx.Rngs(3))
    graphdef, params, rest = nnx.split(learner, nnx.Param, ...)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (B, L)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(L), (B, L))
    perturbed = nnx.to_pure_dict(params)
    for i in CONFIG.moe_layers:
        gate = perturbed["layers"][i]["mlp"]["gate"]
        noise = jax.random.normal(jax.random.key(i), gate.shape)
        perturbed["layers"][i]["mlp"]["gate"] = gate + 1e-3 * noise
    sampler_params = nnx.clone(params)
    nnx.replace_by_pure_dict(sampler_params, perturbed)
    sampler = nnx.merge(graphdef, sampler_params, rest)
    return learner, sampler, tokens, positions


def test_replaying_its_own_routing_changes_nothing(run):
    """Recorded by decode, replayed by the packed forward: the same model gives the same
    log-probs (the routing is aligned with the input tokens, [B, L, moe layers, k])."""
    learner, _, tokens, positions = run
    logits, routed = sample(learner, tokens, positions)
    assert routed.shape == (B, L, len(CONFIG.moe_layers), CONFIG.num_experts_per_tok)
    own, own_ids = learn(learner, tokens, positions)
    replayed, ids = learn(learner, tokens, positions, routed)
    assert (np.asarray(ids) == np.asarray(routed)).all()
    assert (np.asarray(own_ids) == np.asarray(routed)).all()
    assert np.abs(np.asarray(replayed) - np.asarray(own)).max() == 0.0
    assert np.abs(token_logprobs(replayed, tokens) - token_logprobs(logits, tokens)).max() < 1e-5


def test_replay_makes_the_learner_match_the_sampler_when_routing_flips(run):
    learner, sampler, tokens, positions = run
    logits, routed = sample(sampler, tokens, positions)
    want = token_logprobs(logits, tokens)
    recompute, own_ids = learn(learner, tokens, positions)
    replay, used = learn(learner, tokens, positions, routed)
    assert (np.asarray(used) == np.asarray(routed)).all()
    flipped = np.any(
        np.sort(np.asarray(own_ids), -1) != np.sort(np.asarray(routed), -1), axis=(-1, -2)
    )
    assert 0 < flipped.sum() < flipped.size // 4  # some tokens route elsewhere
    d_recompute = np.abs(token_logprobs(recompute, tokens) - want)
    d_replay = np.abs(token_logprobs(replay, tokens) - want)
    assert d_replay.max() < 5e-3 and d_recompute.max() > 10 * d_replay.max()
    # a token whose own routing flipped: its log-prob (and later ones') moves without replay
    assert d_recompute[flipped[:, 1:]].mean() > 5 * d_replay[flipped[:, 1:]].mean()


def test_unrecorded_tokens_route_themselves(run):
    """A negative id (a token the sampler did not record) takes the learner's own top k;
    a routing of the wrong shape is refused."""
    learner, _, tokens, positions = run
    own, own_ids = learn(learner, tokens, positions)
    none = -jnp.ones_like(own_ids)
    got, ids = learn(learner, tokens, positions, none)
    assert (np.asarray(ids) == np.asarray(own_ids)).all()
    assert np.abs(np.asarray(got) - np.asarray(own)).max() == 0.0
    with pytest.raises(ValueError, match=r"routing must be \[batch, length, moe layers, k\]"):
        learner(tokens, positions, jnp.ones_like(tokens), routing=own_ids[:, :, :1])
