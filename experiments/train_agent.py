"""Train an agent with task-level RL (the main job).

    python experiments/train_agent.py --config=experiments/configs/calculator.py \
        --config.rl.optimizer.learning_rate=5e-4 --config.workdir=runs/calc
    python experiments/train_agent.py --config=experiments/configs/calculator.py:quick

The part after ':' picks a variant of the config file (`get_config(variant)`).
"""

import json
import logging
import os
import sys

from absl import app
from absl import logging as absl_logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import calculator_agent  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/calculator.py")


def main(argv):
    del argv
    absl_logging.set_verbosity(absl_logging.WARNING)   # Orbax logs every save at INFO
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per HTTP request
    report = calculator_agent.run(_CONFIG.value)
    print(json.dumps(report, indent=2))
    print(f"report: {_CONFIG.value.workdir}/report")


if __name__ == "__main__":
    app.run(main)
