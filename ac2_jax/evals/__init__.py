"""Evals: repeated runs with confidence intervals, pass@k, process and cost metrics."""

from ac2_jax.evals.audit import (AuditConfig, AuditReport, audit, audit_traces, count_tool_calls,
                                 no_tool_call)
from ac2_jax.evals.cost import (PrefixStats, TokenCost, TokenPrices, common_prefix_len,
                                prefix_stats, request_prefix_reuse, token_cost, trace_tokens)
from ac2_jax.evals.passk import (pass_at_k, pass_at_k_interval, pass_hat_k, pass_hat_k_interval,
                                 pass_k_values)
from ac2_jax.evals.runner import Comparison, EvalResult, attempt_seed, compare_results, evaluate
from ac2_jax.evals.stats import (Estimate, bootstrap_interval, clustered_interval, mean_interval,
                                 paired_difference, t_quantile, wilson_interval, z_quantile)
from ac2_jax.evals.summary import (AttemptRecord, attempt_record, group_summary, jsonable,
                                   summarize, task_summary)

__all__ = [
    "AttemptRecord",
    "AuditConfig",
    "AuditReport",
    "Comparison",
    "Estimate",
    "EvalResult",
    "PrefixStats",
    "TokenCost",
    "TokenPrices",
    "attempt_record",
    "attempt_seed",
    "audit",
    "audit_traces",
    "bootstrap_interval",
    "clustered_interval",
    "common_prefix_len",
    "compare_results",
    "count_tool_calls",
    "evaluate",
    "group_summary",
    "jsonable",
    "mean_interval",
    "no_tool_call",
    "paired_difference",
    "pass_at_k",
    "pass_at_k_interval",
    "pass_hat_k",
    "pass_hat_k_interval",
    "pass_k_values",
    "prefix_stats",
    "request_prefix_reuse",
    "summarize",
    "t_quantile",
    "task_summary",
    "token_cost",
    "trace_tokens",
    "wilson_interval",
    "z_quantile",
]
