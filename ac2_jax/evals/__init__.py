"""evals layer."""
