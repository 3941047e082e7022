"""Many domains adaptively mixed: the RL recipe's config for 30 reasoning-gym generators
(`python -m ac2_jax.train --config=experiments/rg_mix/config.py`) and the verifier audit of
every generator (`python -m experiments.rg_mix.verifier_audit`; issue 63).
"""
