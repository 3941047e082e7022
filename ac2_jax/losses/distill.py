"""Teacher-student divergences for on-policy self-distillation (pure, jit-able).

Student and teacher logits are both [..., L, V] and aligned with `targets`
[..., L] (the student's own response tokens): position p of both holds the
prediction of `targets[p]`, the student with its context, the teacher with the
hint inserted before the response. Gathering the response positions of the
two forward passes into this alignment is the caller's job.

Every function returns a per-position value [..., L]; aggregate it with
`ac2_jax.losses.aggregate_loss`. Teacher gradients are always stopped.

Options shared by all kinds:
- `temperature` T > 0 divides both logits before the softmax (no T^2 factor).
- `top_k` k restricts both distributions to the teacher's k most likely tokens
  at that position and renormalizes each over those k tokens (full-vocabulary
  kinds only). `top_k >= V` equals the full vocabulary.

kind="sampled" (`sampled_token_loss`) is the reverse-KL estimator on the
sampled token: it scores y under the student's sampling distribution (the
temperature / top-k / top-p y was drawn with, per position) and the teacher at
that temperature, and weights a token drawn by another policy with the
truncated importance weight against its recorded log-probs.

Generalized JSD follows Eq. (1) of the GKD paper (Agarwal et al. 2023,
arXiv:2306.13649), with P the teacher and Q the student:
  JSD(beta) = beta KL(P || M) + (1 - beta) KL(Q || M),  M = beta P + (1 - beta) Q.
beta = 0.5 is the symmetric JSD. The interior formula vanishes at both ends,
so the KLs appear only after rescaling:
  JSD(beta) / beta       -> KL(teacher || student)  (forward KL) as beta -> 0,
  JSD(beta) / (1 - beta) -> KL(student || teacher)  (reverse KL) as beta -> 1.
Hence `beta` must lie strictly in (0, 1); use kind="forward_kl" or
"reverse_kl" for the endpoints.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from ac2_jax.losses.logprobs import token_logprobs
from ac2_jax.registry import Registry

# Per-position divergences by name (`distill_loss(kind=...)`, `DistillLoss.kind`).
# Each entry: fn(student_logits, teacher_logits, targets, *, beta, top_k,
# temperature) -> [..., L]. A new one is a function registered from its own
# module: `@DIVERGENCES.register("name")`.
DIVERGENCES: Registry = Registry("divergence")


def _check_logits(student_logits, teacher_logits):
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"distill: student_logits {student_logits.shape} and teacher_logits "
            f"{teacher_logits.shape} must have the same [..., L, V] shape"
        )
    if student_logits.ndim < 2:
        raise ValueError(f"distill: logits must be [..., L, V], got shape {student_logits.shape}")


def _check_temperature(temperature):
    if isinstance(temperature, numbers.Number) and not temperature > 0:
        raise ValueError(f"distill: temperature must be > 0, got {temperature}")


def _log_probs(student_logits, teacher_logits, temperature=1.0, top_k=None):
    """Student and teacher log-probs [..., L, V'] with V' = min(top_k, V) or V."""
    _check_logits(student_logits, teacher_logits)
    _check_temperature(temperature)
    s = student_logits.astype(jnp.float32) / temperature
    t = jax.lax.stop_gradient(teacher_logits.astype(jnp.float32)) / temperature
    if top_k is not None:
        if not isinstance(top_k, numbers.Integral) or top_k < 1:
            raise ValueError(f"distill: top_k must be a positive int or None, got {top_k!r}")
        k = min(int(top_k), t.shape[-1])
        _, idx = jax.lax.top_k(t, k)  # [..., L, k], ties: lower token id first
        t = jnp.take_along_axis(t, idx, axis=-1)
        s = jnp.take_along_axis(s, idx, axis=-1)
    return jax.nn.log_softmax(s, axis=-1), jax.nn.log_softmax(t, axis=-1)


def _kl(logp, logq):
    """KL(p || q) over the last axis, 0 log 0 = 0. [..., V] -> [...]."""
    p = jnp.exp(logp)
    diff = jnp.where(p > 0, logp - logq, 0.0)
    return jnp.sum(p * diff, axis=-1)


def reverse_kl(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> jax.Array:
    """KL(student || teacher) per position (mode-seeking; the default).

    student_logits, teacher_logits: [..., L, V]. Returns [..., L] >= 0.
    """
    ls, lt = _log_probs(student_logits, teacher_logits, temperature, top_k)
    return _kl(ls, lt)


def forward_kl(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> jax.Array:
    """KL(teacher || student) per position (mode-covering).

    student_logits, teacher_logits: [..., L, V]. Returns [..., L] >= 0.
    """
    ls, lt = _log_probs(student_logits, teacher_logits, temperature, top_k)
    return _kl(lt, ls)


def generalized_jsd(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> jax.Array:
    """GKD's JSD(beta) per position (see the module docstring for the limits).

    student_logits, teacher_logits: [..., L, V]; 0 < beta < 1. Returns [..., L] >= 0.
    """
    if isinstance(beta, numbers.Number) and not 0.0 < beta < 1.0:
        raise ValueError(
            f"generalized_jsd: beta must be in (0, 1), got {beta}; use "
            "kind='forward_kl' (beta -> 0) or 'reverse_kl' (beta -> 1) for the ends"
        )
    ls, lt = _log_probs(student_logits, teacher_logits, temperature, top_k)
    b = jnp.asarray(beta, jnp.float32)
    log_m = jnp.logaddexp(jnp.log(b) + lt, jnp.log1p(-b) + ls)
    return b * _kl(lt, log_m) + (1.0 - b) * _kl(ls, log_m)


def sampled_token_advantage(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    targets: jax.Array,
    *,
    temperature=1.0,
    top_k=None,
    top_p=None,
) -> jax.Array:
    """Per-token advantage log p_t(y_t) - log pi_s(y_t), gradient stopped.

    pi_s is the student's sampling distribution (logits / temperature, then
    top-k, then top-p: `sampling_logits`), p_t the teacher's at the same
    temperature over the whole vocabulary (a filtered teacher would put no mass
    where the student samples). temperature / top_k / top_p: scalars or
    [..., L] (each token at the parameters it was drawn with).
    logits: [..., L, V]; targets: [..., L] int (the sampled tokens y). Returns [..., L].
    """
    lp_s, lp_t = _sampled_logprobs(
        student_logits, teacher_logits, targets, temperature, top_k, top_p
    )
    return jax.lax.stop_gradient(lp_t - lp_s)


def _sampled_logprobs(student_logits, teacher_logits, targets, temperature, top_k, top_p):
    _check_logits(student_logits, teacher_logits)
    _check_temperature(temperature)
    lp_s = token_logprobs(
        student_logits, targets, temperature=temperature, top_k=top_k, top_p=top_p
    )
    lp_t = token_logprobs(jax.lax.stop_gradient(teacher_logits), targets, temperature=temperature)
    return lp_s, lp_t


def sampled_token_loss(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    targets: jax.Array,
    *,
    temperature=1.0,
    top_k=None,
    top_p=None,
    sampler_logprobs: jax.Array | None = None,
    recorded: jax.Array | None = None,
    tis_cap: float | None = None,
    return_weights: bool = False,
):
    """-w * stop_grad(adv) * log pi_s(y_t): a policy-gradient estimate of reverse KL.

    adv = `sampled_token_advantage` (pi_s: the student's sampling distribution
    at temperature / top_k / top_p, scalars or [..., L]; p_t: the teacher at
    that temperature). On tokens drawn from pi_s, E[grad] = grad KL(pi_s || p_t).
    Tokens drawn by another policy mu (an older student) pass its recorded
    log-probs `sampler_logprobs` [..., L]: w = min(pi_s(y) / mu(y), tis_cap)
    (no gradient; tis_cap None: untruncated, unbiased), 1 where `recorded`
    [..., L] is 0 (no behaviour log-probs: taken as drawn from pi_s).
    logits: [..., L, V]; targets: [..., L] int. Returns [..., L], or
    ([..., L] loss, [..., L] w) with return_weights.
    """
    lp_s, lp_t = _sampled_logprobs(
        student_logits, teacher_logits, targets, temperature, top_k, top_p
    )
    w = jnp.ones_like(lp_s)
    if sampler_logprobs is not None:
        w = jnp.exp(jax.lax.stop_gradient(lp_s) - sampler_logprobs.astype(jnp.float32))
        if tis_cap is not None:
            w = jnp.minimum(w, tis_cap)
        if recorded is not None:
            w = jnp.where(recorded > 0, w, 1.0)
    loss = -w * jax.lax.stop_gradient(lp_t - lp_s) * lp_s
    return (loss, w) if return_weights else loss


def distill_loss(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    targets: jax.Array | None = None,
    *,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    top_k: int | None = None,
    temperature: float = 1.0,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Per-token self-distillation loss of the divergence registered as `kind`.

    student_logits, teacher_logits: [..., L, V]; targets: [..., L] int (needed
    for kind="sampled", shape-checked otherwise); mask: optional [..., L]
    weights, the loss is 0 where mask == 0. `beta` is used by "jsd" only;
    `top_k` by the full-vocabulary kinds only. Returns [..., L].
    """
    _check_logits(student_logits, teacher_logits)
    lead = student_logits.shape[:-1]
    if targets is not None and tuple(targets.shape) != tuple(lead):
        raise ValueError(
            f"distill_loss: targets {targets.shape} must be logits.shape[:-1] = {lead}"
        )
    if mask is not None and tuple(mask.shape) != tuple(lead):
        raise ValueError(f"distill_loss: mask {mask.shape} must be logits.shape[:-1] = {lead}")
    try:
        divergence = DIVERGENCES.get(kind)
    except ValueError as e:
        raise ValueError(f"distill_loss: kind: {e}") from None
    loss = divergence(
        student_logits, teacher_logits, targets, beta=beta, top_k=top_k, temperature=temperature
    )
    if mask is not None:
        loss = jnp.where(mask > 0, loss, 0.0)
    return loss


@DIVERGENCES.register("reverse_kl")
def _reverse_kl(student_logits, teacher_logits, targets, *, beta, top_k, temperature):
    return reverse_kl(student_logits, teacher_logits, temperature=temperature, top_k=top_k)


@DIVERGENCES.register("forward_kl")
def _forward_kl(student_logits, teacher_logits, targets, *, beta, top_k, temperature):
    return forward_kl(student_logits, teacher_logits, temperature=temperature, top_k=top_k)


@DIVERGENCES.register("jsd")
def _jsd(student_logits, teacher_logits, targets, *, beta, top_k, temperature):
    return generalized_jsd(
        student_logits, teacher_logits, beta=beta, temperature=temperature, top_k=top_k
    )


@DIVERGENCES.register("sampled")
def _sampled(student_logits, teacher_logits, targets, *, beta, top_k, temperature):
    if targets is None:
        raise ValueError("distill_loss: kind='sampled' needs targets (the sampled tokens)")
    if top_k is not None:
        raise ValueError("distill_loss: top_k applies to full-vocabulary kinds, not 'sampled'")
    return sampled_token_loss(student_logits, teacher_logits, targets, temperature=temperature)


DISTILL_KINDS = DIVERGENCES.names()  # the built-in ones (registered above)
