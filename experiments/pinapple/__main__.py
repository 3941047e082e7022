"""`python -m experiments.pinapple` runs `experiments.pinapple.run` as the main module
(its flags, its `__main__` block)."""

import runpy

runpy.run_module("experiments.pinapple.run", run_name="__main__", alter_sys=True)
