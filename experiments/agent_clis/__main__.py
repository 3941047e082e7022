"""`python -m experiments.agent_clis` runs `experiments.agent_clis.run` as the main module
(its flags, its `__main__` block)."""

import runpy

runpy.run_module("experiments.agent_clis.run", run_name="__main__", alter_sys=True)
