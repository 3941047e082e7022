"""Pure JAX loss pieces: log-probs, masks, aggregation, policy gradient."""

from ac2_jax.losses.aggregation import MODES, aggregate_loss
from ac2_jax.losses.logprobs import token_entropy, token_logprobs
from ac2_jax.losses.masks import attention_mask, segment_attention_mask, tree_attention_mask
from ac2_jax.losses.policy_gradient import (group_advantages, policy_gradient_loss,
                                            policy_gradient_metrics)

__all__ = [
    "MODES",
    "aggregate_loss",
    "attention_mask",
    "group_advantages",
    "policy_gradient_loss",
    "policy_gradient_metrics",
    "segment_attention_mask",
    "token_entropy",
    "token_logprobs",
    "tree_attention_mask",
]
