"""Pure JAX loss pieces: log-probs (dense and chunked from hidden states), grammar masks
(constraints), masks, aggregation, policy gradient (PPO, GSPO, CISPO), KL estimators,
distill, relevance."""

from ac2_jax.losses.aggregation import MODES, aggregate_loss, loss_weights
from ac2_jax.losses.aggregation import resolve_mode as resolve_mode
from ac2_jax.losses.chunked import LMHead, chunked_token_logprobs
from ac2_jax.losses.chunked import chunked_distill_loss as chunked_distill_loss
from ac2_jax.losses.chunked import chunked_logits_map as chunked_logits_map
from ac2_jax.losses.chunked import chunked_token_entropy as chunked_token_entropy
from ac2_jax.losses.cispo import cispo_loss as cispo_loss
from ac2_jax.losses.constraints import constrain_logits as constrain_logits
from ac2_jax.losses.constraints import unpack_masks as unpack_masks
from ac2_jax.losses.distill import DISTILL_KINDS as DISTILL_KINDS
from ac2_jax.losses.distill import DIVERGENCES, distill_loss
from ac2_jax.losses.distill import forward_kl as forward_kl
from ac2_jax.losses.distill import generalized_jsd as generalized_jsd
from ac2_jax.losses.distill import reverse_kl as reverse_kl
from ac2_jax.losses.distill import sampled_token_advantage as sampled_token_advantage
from ac2_jax.losses.distill import sampled_token_loss as sampled_token_loss
from ac2_jax.losses.kl import KL_ESTIMATORS, kl_estimate
from ac2_jax.losses.logprobs import sampling_logits, token_entropy, token_logprobs
from ac2_jax.losses.masks import attention_mask
from ac2_jax.losses.masks import segment_attention_mask as segment_attention_mask
from ac2_jax.losses.masks import tree_attention_mask as tree_attention_mask
from ac2_jax.losses.policy_gradient import group_advantages, policy_gradient_loss
from ac2_jax.losses.policy_gradient import policy_gradient_metrics as policy_gradient_metrics
from ac2_jax.losses.relevance import candidate_mask as candidate_mask
from ac2_jax.losses.relevance import masked_token_mean as masked_token_mean
from ac2_jax.losses.relevance import ranked_positions as ranked_positions
from ac2_jax.losses.relevance import relevance_loss as relevance_loss
from ac2_jax.losses.relevance import relevance_mask as relevance_mask
from ac2_jax.losses.relevance import selection_mask as selection_mask
from ac2_jax.losses.sequence_ratio import gspo_loss as gspo_loss
from ac2_jax.losses.sequence_ratio import sequence_log_ratio as sequence_log_ratio

__all__ = [
    "token_logprobs",
    "token_entropy",
    "sampling_logits",
    "chunked_token_logprobs",
    "LMHead",
    "attention_mask",
    "aggregate_loss",
    "MODES",
    "loss_weights",
    "policy_gradient_loss",
    "group_advantages",
    "KL_ESTIMATORS",
    "kl_estimate",
    "DIVERGENCES",
    "distill_loss",
]
