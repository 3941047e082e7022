"""Sampling pieces of the JaxSampler's decode loop: filters, keys, draws."""

import jax
import jax.numpy as jnp
import numpy as np

from ac2_jax.losses.logprobs import sampling_logits
from ac2_jax.sampling.engine.decode_loop import (
    first_argmax,
    inverse_cdf_draw,
    row_keys,
    sample_tokens,
)

LOGITS = np.log(np.array([0.4, 0.25, 0.15, 0.1, 0.06, 0.04], np.float32))


def _filter(logits, top_k, top_p):
    B = logits.shape[0]
    return np.asarray(jax.jit(sampling_logits)(
        jnp.asarray(logits), 1.0, jnp.full((B,), top_k, jnp.int32), jnp.full((B,), top_p)))


def test_filter_top_k_and_top_p():
    x = LOGITS[None]
    np.testing.assert_array_equal(_filter(x, -1, 1.0), x)  # both off: unchanged
    kept = lambda f: np.flatnonzero(np.isfinite(f[0])).tolist()  # noqa: E731
    assert kept(_filter(x, 2, 1.0)) == [0, 1]
    # Nucleus: the smallest prefix whose mass reaches top_p (0.4 + 0.25 + 0.15 >= 0.7).
    assert kept(_filter(x, -1, 0.7)) == [0, 1, 2]
    assert kept(_filter(x, -1, 0.65)) == [0, 1]
    assert kept(_filter(x, -1, 0.01)) == [0]
    assert kept(_filter(x, 2, 0.9)) == [0, 1]  # top-k first, then top-p within it
    # Order in the vocabulary does not matter.
    perm = np.array([3, 0, 5, 1, 4, 2])
    assert kept(_filter(x[:, perm], -1, 0.7)) == sorted(np.flatnonzero(np.isin(perm, [0, 1, 2])))


def test_keys_depend_only_on_seed_and_index():
    k1 = row_keys(jnp.array([1, 2], jnp.uint32), jnp.array([0, 0], jnp.uint32), jnp.array([5, 5]))
    k2 = row_keys(jnp.array([2], jnp.uint32), jnp.array([0], jnp.uint32), jnp.array([5]))
    np.testing.assert_array_equal(jax.random.key_data(k1[1]), jax.random.key_data(k2[0]))
    assert not np.array_equal(jax.random.key_data(k1[0]), jax.random.key_data(k1[1]))


def test_sample_frequencies_follow_the_filtered_distribution():
    n = 20000
    logits = jnp.tile(jnp.asarray(LOGITS), (n, 1))
    keys = row_keys(jnp.arange(n, dtype=jnp.uint32), jnp.zeros(n, jnp.uint32), jnp.zeros(n, jnp.int32))
    draw = jax.jit(lambda *a: sample_tokens(*a)[0])

    def freq(temperature, top_k, top_p):
        t = draw(logits, keys, jnp.full((n,), temperature), jnp.full((n,), top_k, jnp.int32),
                 jnp.full((n,), top_p))
        return np.bincount(np.asarray(t), minlength=6) / n

    p = np.exp(LOGITS)
    np.testing.assert_allclose(freq(1.0, -1, 1.0), p, atol=0.015)
    nucleus = np.where(np.arange(6) < 3, p, 0) / p[:3].sum()
    np.testing.assert_allclose(freq(1.0, -1, 0.7), nucleus, atol=0.015)
    hot = p ** 2 / (p ** 2).sum()  # temperature 0.5 squares the probabilities
    np.testing.assert_allclose(freq(0.5, -1, 1.0), hot, atol=0.015)
    np.testing.assert_array_equal(freq(0.0, -1, 1.0), np.eye(6)[0])  # greedy
    # A greedy row stays greedy when it shares the batch with sampled rows.
    mixed = draw(logits[:4], keys[:4], jnp.array([0.0, 1.0, 0.0, 1.0]),
                 jnp.full((4,), -1, jnp.int32), jnp.ones(4))
    assert int(mixed[0]) == int(mixed[2]) == 0


def test_recorded_logprobs_are_those_of_the_sampling_distribution():
    """The log-probs returned with a draw are log_softmax(logits / T) after top-k/top-p."""
    logits = jnp.tile(jnp.asarray(LOGITS), (3, 1))
    keys = row_keys(jnp.arange(3, dtype=jnp.uint32), jnp.zeros(3, jnp.uint32), jnp.zeros(3, jnp.int32))
    tok, logp = jax.jit(sample_tokens)(logits, keys, jnp.array([0.3, 1.0, 0.5]),
                                       jnp.array([2, -1, -1], jnp.int32), jnp.array([1.0, 1.0, 0.7]))
    p = np.exp(LOGITS.astype(np.float64))
    cold = p[:2] ** (1 / 0.3) / (p[:2] ** (1 / 0.3)).sum()       # T=0.3, top-2
    np.testing.assert_allclose(np.exp(np.asarray(logp[0, :2])), cold, rtol=1e-5)
    assert np.all(np.isneginf(np.asarray(logp[0, 2:])))
    np.testing.assert_allclose(np.asarray(logp[1]), np.log(p), atol=1e-6)  # T=1, no filter
    # T=0.5, then the nucleus: the smallest prefix of q whose mass reaches 0.7.
    kept = np.isfinite(np.asarray(logp[2]))
    q = p ** 2 / (p ** 2).sum()
    n_keep = int(np.searchsorted(np.cumsum(q), 0.7) + 1)
    assert kept.sum() == n_keep
    np.testing.assert_allclose(np.exp(np.asarray(logp[2, :n_keep])), q[:n_keep] / q[:n_keep].sum(),
                               rtol=1e-5)
    assert int(tok[0]) in (0, 1)


def test_first_argmax_equals_argmax_with_ties():
    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, size=(64, 300)).astype(np.float32)  # many tied maxima
    x[5] = -np.inf
    x[6, :] = 2.0
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(jnp.asarray(x))),
                                  np.argmax(x, axis=-1))


def test_inverse_cdf_draw_matches_the_cdf_and_never_draws_excluded_tokens():
    """Token = first index whose cumulative probability exceeds u (float64 reference,
    u at the midpoints between cdf steps); excluded (-inf) tokens and whole
    zero-mass blocks are never drawn, also at u = 0 and u just below 1."""
    rng = np.random.default_rng(1)
    V, block = 200, 64  # V not a multiple of the block: padded
    logits = rng.normal(size=V).astype(np.float32)
    logits[[0, 1, 70, 199]] = -np.inf
    logits[128:192] = -np.inf  # a whole block without mass
    p = np.exp(logits.astype(np.float64) - logits[np.isfinite(logits)].max())
    cdf = np.cumsum(p) / p.sum()
    lo = np.concatenate([[0.0], cdf[:-1]])
    mids = ((lo + cdf) / 2)[p > 0]  # one u inside each drawable token's interval
    u = np.concatenate([mids, [0.0, 1.0 - 2.0 ** -24]]).astype(np.float32)
    draw = jax.jit(lambda x, u: inverse_cdf_draw(x, u, block=block))
    got = np.asarray(draw(jnp.tile(jnp.asarray(logits), (len(u), 1)), jnp.asarray(u)))
    allowed = np.flatnonzero(p > 0)
    np.testing.assert_array_equal(got[:len(mids)], allowed)  # each token from its interval
    assert got[-2] == allowed[0] and got[-1] == allowed[-1]
    assert np.all(np.isfinite(logits[got]))
    # A one-token distribution (top-k 1) always gives that token.
    one = np.full((3, V), -np.inf, np.float32)
    one[:, 150] = 1.0
    np.testing.assert_array_equal(np.asarray(draw(jnp.asarray(one), jnp.array([0.0, 0.5, 0.9999999]))),
                                  [150, 150, 150])
