"""`python -m experiments.rl_split` runs `experiments.rl_split.run` as the main module
(its flags, its `__main__` block)."""

import runpy

runpy.run_module("experiments.rl_split.run", run_name="__main__", alter_sys=True)
