"""Per-turn credit vs the final reward alone on a two-turn toy env (issue 64; `python -m
experiments.turn_credit`).
"""
