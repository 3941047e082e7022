"""`python -m experiments.whole_trace` runs `experiments.whole_trace.ablation` as the main module
(its flags, its `__main__` block)."""

import runpy

runpy.run_module("experiments.whole_trace.ablation", run_name="__main__", alter_sys=True)
