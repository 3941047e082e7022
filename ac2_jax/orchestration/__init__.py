"""orchestration layer."""
