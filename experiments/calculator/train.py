"""Train an agent with task-level RL (the main job): SFT warm start, eval, RL, eval.

    python -m experiments.calculator --config=experiments/calculator/config.py \
        --config.rl.optimizer.learning_rate=5e-4 --config.workdir=runs/calc
    python -m experiments.calculator --config=experiments/calculator/config.py:quick

The part after ':' picks a variant of the config file (`get_config(variant)`).
The evals and RL run through the RL recipe (`ac2_jax.recipes.arl`); to train
your own model on your own env, use `python -m ac2_jax.train` instead. The
report (JSON, plots, trace pages) goes to WORKDIR/report; the console gets
one line per step and the headline figures.
"""

import os
import sys

from absl import app
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from ac2_jax.train import quiet_libraries  # noqa: E402
from experiments.calculator import agent as calculator_agent  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/calculator/config.py")


def _rate(r: dict) -> str:
    lo, hi = r["pass_rate_ci95"]
    return f"{r['pass_rate']:.3f} [{lo:.3f}, {hi:.3f}]"


def main(argv):
    del argv
    quiet_libraries()
    report = calculator_agent.run(_CONFIG.value)
    imp = report["improvement"]
    print(f"pass rate: SFT {_rate(report['sft_pass_rate'])} -> RL {_rate(report['rl_pass_rate'])}")
    print(f"improvement {imp['mean']:+.3f} [{imp['ci95'][0]:+.3f}, {imp['ci95'][1]:+.3f}]"
          f" in {report['rl_steps']} RL steps, {report['times_s']['total']:.0f}s")
    print(f"report: {os.path.abspath(_CONFIG.value.workdir)}/report/report.json")


if __name__ == "__main__":
    app.run(main)
