"""Deprecated: moved to `ac2_jax.text.chat_template` (this alias goes in the next release)."""

from ac2_jax._deprecation import moved_module

moved_module(__name__)
