"""`python -m experiments.turn_credit` runs `experiments.turn_credit.run` as the main module
(its flags, its `__main__` block)."""

import runpy

runpy.run_module("experiments.turn_credit.run", run_name="__main__", alter_sys=True)
