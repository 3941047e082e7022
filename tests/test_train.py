"""The launcher, `python -m ac2_jax.train`, run as a user runs it (a subprocess).

Every mistake is one line on stderr with exit status 2, never a traceback.

A child process costs ~3 s of CPU in imports alone (JAX, torch, transformers), so the
runs of this file share children: `launch_all` runs several command lines one after
the other in one child, each through `main()` with its own stdout/stderr (file
descriptors 1 and 2 redirected, so whatever a library writes is caught) and its own
current folder, and reports each one's exit status as the interpreter would (an
uncaught exception: its traceback on stderr, status 1; `SystemExit`: its code).
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _child_env() -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu",
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


_MANY = r"""
import json, os, sys, tempfile, traceback
runs, out_path = json.load(open(sys.argv[1])), sys.argv[2]
results = {}
for run in runs:
    os.chdir(run["cwd"])
    exec(run["prelude"])
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush(); sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1); os.dup2(err.fileno(), 2)
        try:
            from ac2_jax.train import main
            code = main(run["args"])
        except SystemExit as e:  # as the interpreter ends on it
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os.dup2(saved[0], 1); os.dup2(saved[1], 2)
            os.close(saved[0]); os.close(saved[1])
        out.seek(0); err.seek(0)
        results[run["key"]] = {"returncode": code, "stdout": out.read(), "stderr": err.read()}
    exec(run.get("after", ""))
    json.dump(results, open(out_path, "w"))  # after each run: what finished is kept
"""


def launch_all(runs: list[dict], tmp_dir, timeout=600) -> dict:
    """Runs each `{"key", "args", "cwd"?, "prelude"?, "after"?}` in turn in ONE child
    process (see the module docstring); returns key -> (returncode, stdout, stderr).
    `prelude`/`after`: code run in the child before/after that run. A run the child did
    not reach (it died) is missing from the result, which fails the test that reads it."""
    runs = [{"cwd": ROOT, "prelude": "", **r} for r in runs]
    spec, out = os.path.join(tmp_dir, "runs.json"), os.path.join(tmp_dir, "results.json")
    with open(spec, "w") as f:
        json.dump(runs, f)
    proc = subprocess.run([sys.executable, "-c", _MANY, spec, out], cwd=ROOT, env=_child_env(),
                          capture_output=True, text=True, timeout=timeout * len(runs))
    results = json.load(open(out)) if os.path.exists(out) else {}
    return _Runs({k: SimpleNamespace(**v) for k, v in results.items()}, proc)


class _Runs(dict):
    def __missing__(self, key):  # the child died before this run ended
        pytest.fail(f"run {key!r} did not finish: child exit {self.proc.returncode}, "
                    f"stderr: {self.proc.stderr[-3000:]}")

    def __init__(self, runs, proc):
        super().__init__(runs)
        self.proc = proc


def one_line_error(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("ac2_jax.train: error: ")
    return lines[0]


BASE = ["--recipe=rl", "--env=tests.support.recipe_helpers:ParityEnv", "--model=tiny"]
MISTAKES = [
    (["--recipe=rl", "--modle=tiny"], "unknown flag --modle; did you mean --model?"),
    (["--recipe=dpo"], "unknown recipe 'dpo': registered are distill, eval, rl, sft"),
    (["--env=x:Y", "--model=tiny"], "--recipe is required"),
    (["--recipe=rl", "--model=tiny"], "--env is required"),
    (["--recipe=rl", "--model=tiny", "--env=tests.support.recipe_helpers:Nope"], "has no attribute"),
    (["--recipe=rl", "--env=tests.support.recipe_helpers:ParityEnv", "--model=/no/such/dir"],
     "not a directory"),
    (["--recipe=sft", "--env=ac2_jax.envs:CalculatorEnv", "--model=tiny"],
     "recipe 'sft' needs CalculatorEnv.demonstration(task)"),
    ([*BASE, "--tool_parser=hermez"],  # issue 68, finding 5: the format is a flag
     "tool_parser='hermez': unknown tool parser 'hermez'"),
]


@pytest.fixture(scope="module")
def usage(tmp_path_factory):
    """The launcher's mistakes below, all run in one child."""
    tmp = tmp_path_factory.mktemp("usage")
    return launch_all([
        # First, as in a fresh process: fastapi missing; then importable again.
        {"key": "missing_extra", "args": [*BASE, f"--workdir={tmp / 'extra'}"],
         "prelude": "sys.modules['fastapi'] = None", "after": "sys.modules.pop('fastapi')"},
        {"key": "lerning_rate", "args": [*BASE, "--config.rl.lerning_rate=1e-3"]},
        {"key": "lr", "args": [*BASE, "--config.rl.lr=1e-3"]},
        {"key": "bad_value", "args": [*BASE, "--config.rl.steps=lots"]},
        {"key": "help", "args": ["--recipe=distill", "--help"]},
        *({"key": f"mistake_{i}", "args": [*args, f"--workdir={tmp / f'mistake_{i}'}"]}
          for i, (args, _) in enumerate(MISTAKES)),
    ], str(tmp))


def test_a_mistyped_override_is_one_line_naming_the_nearest_fields(usage):
    # Finding: a mistyped override printed a 53-line traceback (ml_collections).
    line = one_line_error(usage["lerning_rate"])
    assert "rl.lerning_rate: no such field in RLConfig" in line
    assert "rl.optimizer.learning_rate (float)" in line
    # Finding: one "did you mean" pointed at the wrong field; an abbreviation finds it.
    assert "nearest: rl.optimizer.learning_rate" in one_line_error(usage["lr"])


def test_a_bad_value_is_one_line_naming_its_type(usage):
    line = one_line_error(usage["bad_value"])
    assert "rl.steps='lots': expected int" in line


@pytest.mark.parametrize("i, says", [(i, says) for i, (_, says) in enumerate(MISTAKES)])
def test_launcher_mistakes_are_one_line(i, says, usage):
    assert says in one_line_error(usage[f"mistake_{i}"])


def test_a_missing_extra_is_one_line_with_the_install_hint(usage):
    # Finding: a missing extra failed with an ImportError deep in a stack.
    line = one_line_error(usage["missing_extra"])
    assert "pip install 'ac2_jax[serve]'" in line


def test_every_field_is_listed_by_help(usage):
    proc = usage["help"]
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


ENVS = ["examples.text_to_sql.env:TextToSQLEnv", "examples.coding.env:CodingEnv"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every training run of this file, one after the other in one child: on each example
    env SFT from a model directory written here, then RL and distillation from that SFT
    run's HF export, each in a fresh working directory; an RL step on the parity env; and
    an RL run whose context is below the prompt. Returns (runs by key, the folder)."""
    from tests.support.recipe_helpers import write_tiny_model

    tmp = tmp_path_factory.mktemp("trained")
    model = write_tiny_model(str(tmp / "model_src"))
    runs = []
    for e, env in enumerate(ENVS):
        for recipe in ("sft", "rl", "distill"):
            work = tmp / f"env{e}" / recipe
            work.mkdir(parents=True)
            start = model if recipe == "sft" else str(tmp / f"env{e}" / "sft" / "run" / "report"
                                                      / "final_hf")
            runs.append({"key": f"{env}/{recipe}", "cwd": str(work), "args": [
                f"--recipe={recipe}", f"--env={env}", f"--model={start}",
                f"--workdir={work / 'run'}", *SMALL[recipe],
                *(ROLLOUT if recipe != "sft" else [])]})
    for key in ("parity", "context"):
        (tmp / key).mkdir()
    runs.append({"key": "parity", "cwd": str(tmp / "parity"), "args": [
        "--recipe=rl", "--env=tests.support.recipe_helpers:ParityEnv", f"--model={model}",
        f"--workdir={tmp / 'parity' / 'run'}", *SMALL["rl"], "--config.rl.attempts_per_task=4",
        *ROLLOUT]})
    runs.append({"key": "context", "cwd": str(tmp / "context"), "args": [
        *BASE, f"--workdir={tmp / 'context' / 'run'}", *SMALL["rl"], *ROLLOUT,
        "--config.sampler.max_context=16"]})
    return launch_all(runs, str(tmp)), tmp


@pytest.mark.parametrize("env", ENVS)
def test_every_recipe_trains_on_each_example_env(env, trained):
    """SFT from a model directory the test writes, then RL and distillation from the
    SFT run's HF export, each in a fresh working directory, all through the launcher."""
    runs, tmp = trained
    e = ENVS.index(env)
    reports = {}
    for recipe in ("sft", "rl", "distill"):
        proc, work = runs[f"{env}/{recipe}"], tmp / f"env{e}" / recipe
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr and "WARNING" not in proc.stderr, proc.stderr
        assert all(len(x) <= 120 for x in proc.stderr.splitlines())
        reports[recipe] = json.load(open(work / "run" / "report" / "report.json"))
        assert reports[recipe]["steps"] == (2 if recipe == "sft" else 1)
        assert os.path.exists(work / "run" / "report" / "config.json")
    assert reports["sft"]["final_loss"] > 0
    # RL: the rollouts were run through the endpoint and rewarded by the env's verifier.
    from ac2_jax.trace import TraceStore

    rollouts = TraceStore(str(tmp / f"env{e}" / "rl" / "run" / "traces" / "rollouts.jsonl")).read()
    assert len(rollouts) == 4 and all(t.status == "finished" for t in rollouts), [
        (t.status, t.metadata.get("artifacts")) for t in rollouts]
    assert all(t.reward is not None for t in rollouts)


def test_an_rl_step_through_the_launcher_updates_the_weights(trained):
    """On the example envs a random model earns no reward, so their RL step has no
    signal (counted, said on the console); on the parity env it updates."""
    runs, tmp = trained
    proc = runs["parity"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    (m,) = [json.loads(x) for x in open(tmp / "parity" / "run" / "metrics" / "metrics.jsonl")]
    assert m["train/skipped_update"] == 0.0 and m["train/grad_norm"] > 0
    assert "[rl] 1/1" in proc.stderr


def test_a_context_below_the_prompt_stops_the_launcher_with_one_line(trained):
    # Issue 68, finding 2: every attempt was agent_error (a 400 kept in trace metadata)
    # and the run went on, saying "every group's rewards tied". Now the console names
    # the errors and the run stops with the reason and the setting to change.
    proc = trained[0]["context"]
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
