"""`python -m experiments.calculator` runs `experiments.calculator.train` as the main module
(its flags, its `__main__` block)."""

import runpy

runpy.run_module("experiments.calculator.train", run_name="__main__", alter_sys=True)
