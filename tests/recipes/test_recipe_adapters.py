"""Environments of other libraries through the launcher, unchanged (one RL step each).

Full tier: the launcher in a child process, as a user runs it.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ["--model=tiny", "--config.rl.steps=1", "--config.rl.tasks_per_step=2",
         "--config.rl.attempts_per_task=2", "--config.rl.batch.rows=2",
         "--config.rl.batch.seq_len=1024", "--config.rl.concurrency=4",
         "--config.rollout.max_tokens=12", "--config.rollout.max_steps=1",
         "--config.sampler.warmup=false"]  # fmt: skip


def launch(*args, cwd):
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run([sys.executable, "-m", "ac2_jax.train", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.mark.full
def test_reasoning_gym_generators_train_in_an_adaptive_mix(tmp_path):
    pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra")
    from reasoning_gym.utils import extract_answer

    from ac2_jax.envs.adapters import ReasoningGymEnv
    from ac2_jax.trace import TraceStore

    run = tmp_path / "run"
    proc = launch("--recipe=rl", "--env=reasoning_gym:chain_sum,gcd", f"--workdir={run}",
                  "--config.mix.adaptive=true", "--config.mix.min_results=1", *SMALL,
                  cwd=str(tmp_path))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "[rl] env audit of 2 domains: no verifier flagged" in proc.stderr
    assert "[rl] step 1 mix (weight/pass rate): " in proc.stderr
    # Every reward is the generator's own score of the answer the policy gave.
    rollouts = TraceStore(str(run / "traces" / "rollouts.jsonl")).read()
    assert len(rollouts) == 4 and all(t.status == "finished" for t in rollouts)
    envs = {g: ReasoningGymEnv(g) for g in ("chain_sum", "gcd")}
    for t in rollouts:
        domain, own_id = t.task_id.split("/", 1)
        env = envs[domain]
        entry = env.dataset[int(own_id.rsplit("-", 1)[1])]
        answer = t.metadata["artifacts"]["answer"]
        assert t.reward == env.dataset.score_answer(extract_answer(answer or ""), entry)
    (mix,) = [json.loads(x) for x in open(run / "report" / "mix.jsonl")]
    assert sorted(mix["mix_weight"]) == ["chain_sum", "gcd"]
    assert abs(sum(mix["mix_weight"].values()) - 1) < 1e-9
    assert os.path.getsize(run / "report" / "mix.png") > 1000
    report = json.load(open(run / "report" / "report.json"))
    assert report["mix_jsonl"].endswith("mix.jsonl")
    assert json.load(open(run / "report" / "env_audit.json"))["flagged"] == []
