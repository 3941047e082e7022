"""Evals: repeated runs with confidence intervals, pass@k, process and cost metrics."""

from ac2_jax._deprecation import deprecated_getattr
from ac2_jax.evals.audit import AuditConfig, AuditReport, audit, audit_traces
from ac2_jax.evals.audit import count_tool_calls as count_tool_calls
from ac2_jax.evals.audit import no_tool_call as no_tool_call
from ac2_jax.evals.cost import PrefixStats as PrefixStats
from ac2_jax.evals.cost import TokenCost as TokenCost
from ac2_jax.evals.cost import TokenPrices, token_cost
from ac2_jax.evals.cost import common_prefix_len as common_prefix_len
from ac2_jax.evals.cost import prefix_stats as prefix_stats
from ac2_jax.evals.cost import request_prefix_reuse as request_prefix_reuse
from ac2_jax.evals.cost import trace_tokens as trace_tokens
from ac2_jax.evals.passk import pass_at_k, pass_hat_k
from ac2_jax.evals.passk import pass_at_k_interval as pass_at_k_interval
from ac2_jax.evals.passk import pass_hat_k_interval as pass_hat_k_interval
from ac2_jax.evals.passk import pass_k_values as pass_k_values
from ac2_jax.evals.runner import Comparison, EvalResult, compare_results, evaluate
from ac2_jax.evals.stats import Estimate, clustered_interval, mean_interval, wilson_interval
from ac2_jax.evals.stats import bootstrap_interval as bootstrap_interval
from ac2_jax.evals.stats import paired_difference as paired_difference
from ac2_jax.evals.stats import t_quantile as t_quantile
from ac2_jax.evals.stats import z_quantile as z_quantile
from ac2_jax.evals.summary import AttemptRecord as AttemptRecord
from ac2_jax.evals.summary import attempt_record as attempt_record
from ac2_jax.evals.summary import jsonable as jsonable
from ac2_jax.evals.summary import summarize

# Renamed or moved; resolve with a DeprecationWarning for one release.
DEPRECATED = {
    "attempt_seed": "ac2_jax.seeds:eval_attempt_seed",
}
__getattr__ = deprecated_getattr(__name__, DEPRECATED)

__all__ = [
    "evaluate",
    "EvalResult",
    "compare_results",
    "Comparison",
    "Estimate",
    "mean_interval",
    "wilson_interval",
    "clustered_interval",
    "pass_at_k",
    "pass_hat_k",
    "summarize",
    "audit",
    "audit_traces",
    "AuditConfig",
    "AuditReport",
    "TokenPrices",
    "token_cost",
]
