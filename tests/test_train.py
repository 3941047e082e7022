"""The launcher, `python -m ac2_jax.train`, run as a user runs it (a subprocess).

Every mistake is one line on stderr with exit status 2, never a traceback.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(*args, cwd=ROOT, prelude="", timeout=600):
    code = f"import sys\n{prelude}\nfrom ac2_jax.train import main\nsys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_line_error(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("ac2_jax.train: error: ")
    return lines[0]


BASE = ["--recipe=rl", "--env=tests.recipe_helpers:ParityEnv", "--model=tiny"]


def test_a_mistyped_override_is_one_line_naming_the_nearest_fields():
    # Finding: a mistyped override printed a 53-line traceback (ml_collections).
    line = one_line_error(launch(*BASE, "--config.rl.lerning_rate=1e-3"))
    assert "rl.lerning_rate: no such field in RLConfig" in line
    assert "rl.optimizer.learning_rate (float)" in line
    # Finding: one "did you mean" pointed at the wrong field; an abbreviation finds it.
    assert "nearest: rl.optimizer.learning_rate" in one_line_error(
        launch(*BASE, "--config.rl.lr=1e-3"))


def test_a_bad_value_is_one_line_naming_its_type():
    line = one_line_error(launch(*BASE, "--config.rl.steps=lots"))
    assert "rl.steps='lots': expected int" in line


@pytest.mark.parametrize("args, says", [
    (["--recipe=rl", "--modle=tiny"], "unknown flag --modle; did you mean --model?"),
    (["--recipe=dpo"], "known recipes are rl, sft, distill"),
    (["--env=x:Y", "--model=tiny"], "--recipe is required"),
    (["--recipe=rl", "--model=tiny"], "--env is required"),
    (["--recipe=rl", "--model=tiny", "--env=tests.recipe_helpers:Nope"], "has no attribute"),
    (["--recipe=rl", "--env=tests.recipe_helpers:ParityEnv", "--model=/no/such/dir"],
     "not a directory"),
    (["--recipe=sft", "--env=ac2_jax.envs:CalculatorEnv", "--model=tiny"],
     "recipe 'sft' needs CalculatorEnv.demonstration(task)"),
])
def test_launcher_mistakes_are_one_line(args, says, tmp_path):
    assert says in one_line_error(launch(*args, f"--workdir={tmp_path}"))


def test_a_missing_extra_is_one_line_with_the_install_hint(tmp_path):
    # Finding: a missing extra failed with an ImportError deep in a stack.
    line = one_line_error(launch(*BASE, f"--workdir={tmp_path}",
                                 prelude="sys.modules['fastapi'] = None"))
    assert "pip install 'ac2_jax[serve]'" in line


def test_every_field_is_listed_by_help():
    proc = launch("--recipe=distill", "--help")
    assert "--config.distill.method" in proc.stderr and "--config.paths.publish" in proc.stderr
