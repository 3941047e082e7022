"""The OPD-vs-RL study's pipeline at toy size (experiments/opd_teacher/run.py): every stage
runs through the recipes and the report holds every figure."""

import json
import os

from ac2_jax.envs import check_env
from experiments.opd_teacher import run as opd_teacher


def test_the_reverse_task_meets_the_contract_and_its_splits_never_overlap():
    env = check_env(opd_teacher.ReverseEnv(), "sft")
    train = {t.prompt for t in env.sample_tasks(200, 0)}
    held = {t.prompt for t in env.sample_tasks(50, 0, "eval")}
    assert not train & held
    task = env.sample_tasks(1, 3)[0]
    assert env.verify(task, " ".join(reversed(task.prompt.split()[1:]))) == 1.0
    assert env.verify(task, task.prompt) == 0.0


def test_the_pipeline_writes_a_complete_report(tmp_path):
    report = opd_teacher.run(str(tmp_path / "run"), "toy", log=lambda *a: None)
    assert json.load(open(tmp_path / "run" / "report.json")) == json.loads(json.dumps(report))
    assert 0.0 <= report["teacher_pass_rate"] <= 1.0
    assert report["params"]["student"] < report["params"]["teacher"]
    for kind in ("opd", "rl"):
        (run,) = report["runs"][kind]
        assert 0.0 <= run["before"] <= 1.0 and 0.0 <= run["after"] <= 1.0
    opd_cfg = json.load(open(tmp_path / "run" / "opd_seed0" / "report" / "config.json"))
    assert opd_cfg["distill"]["teacher"].endswith(os.path.join("teacher", "report", "final_hf"))
    assert opd_cfg["loop"]["hints"] is False
