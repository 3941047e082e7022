"""Evals: repeated runs with confidence intervals, process and cost metrics."""

from ac2_jax.evals.runner import EvalResult, evaluate
from ac2_jax.evals.stats import Estimate, mean_interval, paired_difference, wilson_interval

__all__ = ["Estimate", "EvalResult", "evaluate", "mean_interval", "paired_difference",
           "wilson_interval"]
