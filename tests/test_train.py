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
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
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
    (["--recipe=dpo"], "unknown recipe 'dpo': registered are distill, eval, rl, sft"),
    (["--env=x:Y", "--model=tiny"], "--recipe is required"),
    (["--recipe=rl", "--model=tiny"], "--env is required"),
    (["--recipe=rl", "--model=tiny", "--env=tests.recipe_helpers:Nope"], "has no attribute"),
    (["--recipe=rl", "--env=tests.recipe_helpers:ParityEnv", "--model=/no/such/dir"],
     "not a directory"),
    (["--recipe=sft", "--env=ac2_jax.envs:CalculatorEnv", "--model=tiny"],
     "recipe 'sft' needs CalculatorEnv.demonstration(task)"),
    ([*BASE, "--tool_parser=hermez"],  # issue 68, finding 5: the format is a flag
     "tool_parser='hermez': unknown tool parser 'hermez'"),
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


SMALL = {  # report files (curve, pages, heatmap) off: the first-day test checks them
    "sft": ["--config.log.report_files=false", "--config.demos.num_tasks=4", "--config.sft.steps=2", "--config.sft.batch_rows=2",
            "--config.sft.seq_len=1024", "--config.sft.checkpoint_every=0"],
    "rl": ["--config.log.report_files=false", "--config.rl.steps=1", "--config.rl.tasks_per_step=2",
           "--config.rl.attempts_per_task=2", "--config.rl.batch.rows=2",
           "--config.rl.batch.seq_len=1024", "--config.rl.concurrency=4"],
    "distill": ["--config.log.report_files=false", "--config.loop.steps=1", "--config.loop.tasks_per_step=2",
                "--config.loop.concurrency=4", "--config.distill.seq_len=1024"],
}
ROLLOUT = ["--config.rollout.max_tokens=12", "--config.rollout.max_steps=2",
           "--config.sampler.warmup=false"]


@pytest.mark.parametrize("env", ["examples.text_to_sql.env:TextToSQLEnv",
                                 "examples.coding.env:CodingEnv"])
def test_every_recipe_trains_on_each_example_env(env, tmp_path):
    """SFT from a model directory the test writes, then RL and distillation from the
    SFT run's HF export, each in a fresh working directory, all through the launcher."""
    import json

    from tests.recipe_helpers import write_tiny_model

    model = write_tiny_model(str(tmp_path / "model_src"))
    reports = {}
    for recipe in ("sft", "rl", "distill"):
        work = tmp_path / recipe
        work.mkdir()
        start = model if recipe == "sft" else str(tmp_path / "sft" / "run" / "report" / "final_hf")
        proc = launch(f"--recipe={recipe}", f"--env={env}", f"--model={start}",
                      f"--workdir={work / 'run'}", *SMALL[recipe],
                      *(ROLLOUT if recipe != "sft" else []), cwd=str(work))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "WARNING" not in proc.stderr, proc.stderr
        assert all(len(x) <= 120 for x in proc.stderr.splitlines())
        reports[recipe] = json.load(open(work / "run" / "report" / "report.json"))
        assert reports[recipe]["steps"] == (2 if recipe == "sft" else 1)
        assert os.path.exists(work / "run" / "report" / "config.json")
    assert reports["sft"]["final_loss"] > 0
    # RL: the rollouts were run through the endpoint and rewarded by the env's verifier.
    from ac2_jax.trace import TraceStore

    rollouts = TraceStore(str(tmp_path / "rl" / "run" / "traces" / "rollouts.jsonl")).read()
    assert len(rollouts) == 4 and all(t.status == "finished" for t in rollouts), [
        (t.status, t.metadata.get("artifacts")) for t in rollouts]
    assert all(t.reward is not None for t in rollouts)


def test_an_rl_step_through_the_launcher_updates_the_weights(tmp_path):
    """On the example envs a random model earns no reward, so their RL step has no
    signal (counted, said on the console); on the parity env it updates."""
    import json

    from tests.recipe_helpers import write_tiny_model

    model = write_tiny_model(str(tmp_path / "src"))
    proc = launch("--recipe=rl", "--env=tests.recipe_helpers:ParityEnv", f"--model={model}",
                  f"--workdir={tmp_path / 'run'}", *SMALL["rl"], "--config.rl.attempts_per_task=4",
                  *ROLLOUT, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (m,) = [json.loads(x) for x in open(tmp_path / "run" / "metrics" / "metrics.jsonl")]
    assert m["train/skipped_update"] == 0.0 and m["train/grad_norm"] > 0
    assert "[rl] 1/1" in proc.stderr


def test_a_context_below_the_prompt_stops_the_launcher_with_one_line(tmp_path):
    # Issue 68, finding 2: every attempt was agent_error (a 400 kept in trace metadata)
    # and the run went on, saying "every group's rewards tied". Now the console names
    # the errors and the run stops with the reason and the setting to change.
    proc = launch(*BASE, f"--workdir={tmp_path / 'run'}", *SMALL["rl"], *ROLLOUT,
                  "--config.sampler.max_context=16", cwd=str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "rewards tied" not in proc.stderr
    assert "[rl] step 1: 4 of 4 attempts ended agent_error" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ac2_jax.train: error: every attempt of rl step 1 (4 of 4) failed")
    assert "maximum context length is 16" in last and "sampler.max_context=16" in last


def test_resume_and_overwrite_are_flags_and_exclusive(tmp_path):
    # Issue 68, finding 3: resuming is explicit (`--resume`), as is starting afresh.
    from ac2_jax.train import UsageError, build

    args = [*BASE, f"--workdir={tmp_path}"]
    assert build(args)[3].paths.existing == "refuse"
    assert build([*args, "--resume"])[3].paths.existing == "resume"
    assert build([*args, "--overwrite"])[3].paths.existing == "overwrite"
    # Issue 68, finding 5: the tool-call format is a flag (None: the model's own).
    assert build(args)[3].tool_parser is None
    assert build([*args, "--tool_parser=llama3_json"])[3].tool_parser == "llama3_json"
    with pytest.raises(UsageError, match="--resume or --overwrite, not both"):
        build([*args, "--resume", "--overwrite"])
