"""`python -m experiments.attention_tpu_aot` runs `experiments.attention_tpu_aot.run` as the main module
(its flags, its `__main__` block)."""

import runpy

runpy.run_module("experiments.attention_tpu_aot.run", run_name="__main__", alter_sys=True)
