"""CISPO: a clipped, stop-gradient importance weight times the log-prob (pure, jit-able).

MiniMax et al. 2025, "MiniMax-M1" (arXiv 2506.13585), section 3.1:

    J_CISPO = E[ 1/sum_i |o_i| sum_i sum_t sg(r^_i,t) A_i,t log pi(o_i,t) ]   (eq. 4)
    r^_i,t  = clip(r_i,t, 1 - eps_low, 1 + eps_high),  r = pi / pi_old         (eq. 5)

Unlike PPO's clip, which removes the gradient of a clipped token, CISPO clips
only the weight: every token keeps its gradient sg(r^) A grad log pi. The paper
sets no lower bound in practice (eps_low large): `eps_low=None`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def cispo_weight(
    logp: jax.Array, old_logp: jax.Array, eps_low: float | None, eps_high: float
) -> jax.Array:
    """r^ = clip(exp(logp - old_logp), 1 - eps_low, 1 + eps_high), gradient stopped
    (eps_low None: no lower bound). [..., L]."""
    r = jnp.exp(jax.lax.stop_gradient(logp) - old_logp)
    lo = None if eps_low is None else 1.0 - eps_low
    return jnp.clip(r, lo, 1.0 + eps_high)


def cispo_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    eps_low: float | None = None,
    eps_high: float = 4.0,
) -> jax.Array:
    """Per-token CISPO loss l_t = -sg(r^_t) A_t log pi_t (eq. 4-5), zero where
    mask == 0. Aggregate with mode "token_mean" for the paper's 1/sum|o_i|.
    All inputs [..., L]; returns [..., L]."""
    w = cispo_weight(logp, old_logp, eps_low, eps_high)
    return jnp.where(mask > 0, -w * advantages * logp, 0.0)
