"""On-policy distillation from a bigger teacher vs RL at the same budget (issue 64; `python -m
experiments.opd_teacher`).
"""
