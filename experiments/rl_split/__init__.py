"""The RL job as separate processes: endpoint, collector and learner (docs/launch.md;
`python -m experiments.rl_split --role=...`), its config and the toy envs of the plumbing
checks.
"""
