"""The main job: an agent learns to use a calculator tool by task-level RL (issues 18, 19, 32,
38): SFT warm start, eval, RL, eval, report (`python -m experiments.calculator
--config=experiments/calculator/config.py`), its long-horizon (compacting) and subagent
variants, and the checkpoint evaluation (`python -m experiments.calculator.evaluate`).
"""
