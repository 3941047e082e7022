"""Pure JAX loss pieces: log-probs (dense and chunked from hidden states), grammar masks
(constraints), masks, aggregation, policy gradient (PPO, GSPO, CISPO), KL estimators,
distill, relevance."""

from ac2_jax.losses.aggregation import MODES, VERL_MODES, aggregate_loss, loss_weights, resolve_mode
from ac2_jax.losses.chunked import (
    HEAD_LAYOUTS,
    LMHead,
    chunked_distill_loss,
    chunked_logits_map,
    chunked_token_entropy,
    chunked_token_logprobs,
)
from ac2_jax.losses.cispo import cispo_loss, cispo_weight
from ac2_jax.losses.constraints import constrain_logits, unpack_masks
from ac2_jax.losses.distill import (
    DISTILL_KINDS,
    DIVERGENCES,
    distill_loss,
    forward_kl,
    generalized_jsd,
    reverse_kl,
    sampled_token_advantage,
    sampled_token_loss,
)
from ac2_jax.losses.kl import KL_ESTIMATORS, kl_estimate
from ac2_jax.losses.logprobs import sampling_logits, token_entropy, token_logprobs
from ac2_jax.losses.masks import attention_mask, segment_attention_mask, tree_attention_mask
from ac2_jax.losses.policy_gradient import (
    group_advantages,
    policy_gradient_loss,
    policy_gradient_metrics,
)
from ac2_jax.losses.relevance import (
    candidate_mask,
    masked_token_mean,
    ranked_positions,
    relevance_loss,
    relevance_mask,
    selection_mask,
)
from ac2_jax.losses.sequence_ratio import gspo_loss, sequence_log_ratio

__all__ = [
    "DISTILL_KINDS",
    "DIVERGENCES",
    "HEAD_LAYOUTS",
    "LMHead",
    "chunked_distill_loss",
    "chunked_logits_map",
    "chunked_token_entropy",
    "chunked_token_logprobs",
    "candidate_mask",
    "constrain_logits",
    "distill_loss",
    "forward_kl",
    "generalized_jsd",
    "masked_token_mean",
    "ranked_positions",
    "relevance_loss",
    "relevance_mask",
    "reverse_kl",
    "sampled_token_advantage",
    "sampled_token_loss",
    "selection_mask",
    "MODES",
    "VERL_MODES",
    "aggregate_loss",
    "loss_weights",
    "resolve_mode",
    "KL_ESTIMATORS",
    "kl_estimate",
    "cispo_loss",
    "cispo_weight",
    "gspo_loss",
    "sequence_log_ratio",
    "sampling_logits",
    "attention_mask",
    "group_advantages",
    "policy_gradient_loss",
    "policy_gradient_metrics",
    "segment_attention_mask",
    "token_entropy",
    "token_logprobs",
    "tree_attention_mask",
    "unpack_masks",
]
