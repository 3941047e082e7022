"""Example environments built on `ac2_jax.envs.Env`, outside the package.

Kept import-free: a sandbox child imports `examples.coding.runner` and should
load nothing else.
"""
