"""`python -m experiments.opd_teacher` runs `experiments.opd_teacher.run` as the main module
(its flags, its `__main__` block)."""

import runpy

runpy.run_module("experiments.opd_teacher.run", run_name="__main__", alter_sys=True)
