"""Evals: repeated runs with confidence intervals, process and cost metrics."""

from ac2_jax.evals.runner import EvalResult, evaluate
from ac2_jax.evals.stats import Estimate, mean_interval, paired_difference, wilson_interval

__all__ = ["Estimate", "EvalResult", "evaluate", "mean_interval", "paired_difference",
           "wilson_interval"]

from ac2_jax.evals.audit import (AuditConfig, AuditReport, audit, audit_traces,  # noqa: E402
                                 count_tool_calls, no_tool_call)

__all__ += ["AuditConfig", "AuditReport", "audit", "audit_traces", "count_tool_calls",
            "no_tool_call"]
