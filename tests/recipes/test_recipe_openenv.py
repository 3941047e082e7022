"""An OpenEnv environment through the launcher, unchanged: the how-to's commands as a user
runs them (`openenv init echo_env`, then one RL step of `python -m ac2_jax.train
--env=openenv:echo_env.server.app,max_turns=2`), every reward the environment's own.

Full tier: the library's CLI and the launcher in child processes.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["--recipe=rl", "--env=openenv:echo_env.server.app,max_turns=2", "--model=tiny",
        "--config.rl.steps=1", "--config.rl.tasks_per_step=2", "--config.rl.batch.seq_len=1024",
        "--config.rollout.max_tokens=8", "--config.rollout.max_steps=4",
        "--config.sampler.warmup=false"]  # fmt: skip


@pytest.mark.full
def test_an_openenv_environment_trains_through_the_launcher(tmp_path):
    pytest.importorskip("openenv", reason="the openenv extra (not in dev: it brings gradio)")
    from ac2_jax.trace import TraceStore

    openenv = os.path.join(os.path.dirname(sys.executable), "openenv")
    made = subprocess.run([openenv, "init", "echo_env", "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), ROOT])),
    }
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "ac2_jax.train", *ARGS, f"--workdir={run}"],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    rollouts = TraceStore(str(run / "traces" / "rollouts.jsonl")).read()
    assert rollouts and all(t.status == "finished" for t in rollouts), [
        (t.status, t.metadata.get("artifacts", {}).get("error")) for t in rollouts
    ]

    sys.path.insert(0, str(tmp_path))
    try:
        from echo_env.models import EchoAction
        from echo_env.server.echo_env_environment import EchoEnvironment
    finally:
        sys.path.remove(str(tmp_path))
    for t in rollouts:
        answers = json.loads(t.metadata["artifacts"]["answer"])["answers"]
        assert len(answers) == 2  # max_turns: the env's reply ended each episode
        own = EchoEnvironment()
        own.reset(seed=int(t.task_id.rsplit("-", 1)[1]))
        assert t.reward == sum(own.step(EchoAction(message=a)).reward for a in answers)
        (episode,) = t.episodes
        assert len(episode.completions) == 2
