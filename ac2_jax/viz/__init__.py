"""viz layer."""
