"""Per-token estimators of KL(pi || pi_ref) from the sampled tokens (pure, jit-able).

Schulman 2020, "Approximating KL Divergence" (joschu.net/blog/kl-approx.html):
with x ~ pi and log r = log pi_ref(x) - log pi(x),

    k1 = -log r                  unbiased, high variance, can be negative
    k2 = (log r)^2 / 2           biased, low variance, >= 0
    k3 = (r - 1) - log r         unbiased, low variance, >= 0 (GRPO's, eq. 4 of
                                 Shao et al. 2024 "DeepSeekMath"; TRL's beta term)

As a loss term beta * k: at pi == pi_ref each is 0; the gradients of k2 and k3
are then exactly 0 per token, k1's is grad log pi (zero only in expectation
over x ~ pi: prefer k2/k3 as a loss, k1 as a reward penalty). Away from the
reference, the expected gradient of each as a loss (x ~ pi held fixed) is: k1
0, k2 grad KL(pi || pi_ref), k3 grad KL(pi_ref || pi), the forward KL (Tang &
Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL";
tests/training/rl/test_kl_reference.py checks all three exactly).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logp: jax.Array, ref_logp: jax.Array, kind: str = "k3") -> jax.Array:
    """Per-token estimate [..., L] of KL(pi || pi_ref) (module docstring); logp the
    policy's log-probs of the sampled tokens (gradients flow), ref_logp the
    reference's (no gradient)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {kind!r}")
    log_r = jax.lax.stop_gradient(ref_logp).astype(jnp.float32) - logp
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    return jnp.exp(log_r) - 1.0 - log_r
