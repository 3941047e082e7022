"""Environments of other libraries through the launcher, unchanged: one RL step on a mix
of reasoning-gym generators, a verifiers environment, a TextArena game, a Gymnasium
environment and an OpenEnv server made by `openenv init echo_env` as the how-to says (one
launcher run covers the five, to spare the suite five model start-ups).

Full tier. The launcher runs in this process (`ac2_jax.train.main`, what `python -m
ac2_jax.train` calls, from the folder `openenv init` wrote): a child imported the five
libraries a second time (verifiers, gradio under OpenEnv's server, ...), ~15 CPU s of the
test's ~50. tests/test_train.py runs the launcher as a child process, as a user runs it.
"""

import json
import os
import subprocess
import sys

import pytest

VF = "verifiers:ReasoningGymEnv,gym=lcm,num_train_examples=16,num_eval_examples=8"
# 12 tasks drawn with the run's seed cover the 6 domains (chain_sum, gcd,
# ReasoningGymEnv, GuessTheNumber-v0, FrozenLake-v1, EchoEnvironment); the test
# checks that they do.
ENV = (f"mix:reasoning_gym:chain_sum,gcd+{VF}+textarena:GuessTheNumber-v0"
       "+gym:FrozenLake-v1,is_slippery=false+openenv:echo_env.server.app,max_turns=2")  # fmt: skip
ARGS = ["--model=tiny", "--config.rl.steps=1", "--config.rl.tasks_per_step=12",
        "--config.rl.attempts_per_task=1", "--config.rl.batch.rows=2",
        "--config.rl.batch.seq_len=1024", "--config.rl.concurrency=12",
        "--config.rollout.max_tokens=8", "--config.rollout.max_steps=12",
        "--config.sampler.warmup=false", "--config.mix.adaptive=true",
        "--config.mix.min_results=1"]  # fmt: skip


def launch(*args, cwd, capfd, monkeypatch):
    """`python -m ac2_jax.train ARGS` run from `cwd`, in this process: (exit status,
    stderr)."""
    from ac2_jax.train import main

    monkeypatch.chdir(cwd)
    path = list(sys.path)
    capfd.readouterr()
    try:
        rc = main(list(args))
    finally:
        sys.path[:] = path  # main puts the folder first, for --env=pkg.module:Factory
    return rc, capfd.readouterr().err


@pytest.mark.full
def test_five_libraries_envs_train_in_one_adaptive_mix(tmp_path, capfd, monkeypatch):
    """Every reward is the library's own score of what the policy gave: reasoning-gym's
    score_answer, the verifiers rubric's, the TextArena game's, the Gymnasium env's and the
    OpenEnv env's summed step rewards; the mix's weights are on the console and in the
    report."""
    pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra")
    vf = pytest.importorskip("verifiers", reason="the verifiers extra")
    ta = pytest.importorskip("textarena", reason="the textarena extra")
    gym = pytest.importorskip("gymnasium", reason="the gymnasium extra")
    pytest.importorskip("openenv", reason="the openenv extra")
    from reasoning_gym.utils import extract_answer

    from ac2_jax.envs.adapters import ReasoningGymEnv
    from ac2_jax.trace import TraceStore

    openenv = os.path.join(os.path.dirname(sys.executable), "openenv")
    made = subprocess.run([openenv, "init", "echo_env", "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    run = tmp_path / "run"
    rc, stderr = launch("--recipe=rl", f"--env={ENV}", f"--workdir={run}", *ARGS,
                        cwd=str(tmp_path), capfd=capfd, monkeypatch=monkeypatch)
    assert rc == 0, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "[rl] env audit of 6 domains: " in stderr
    assert "[rl] step 1 mix (weight/pass rate): " in stderr
    rollouts = TraceStore(str(run / "traces" / "rollouts.jsonl")).read()
    assert len(rollouts) == 12 and all(t.status != "infra_error" for t in rollouts), [
        (t.status, t.metadata.get("artifacts", {}).get("error")) for t in rollouts]
    by_domain = {}
    for t in rollouts:
        by_domain.setdefault(t.task_id.split("/", 1)[0], []).append(t)
    assert sorted(by_domain) == [
        "EchoEnvironment", "FrozenLake-v1", "GuessTheNumber-v0", "ReasoningGymEnv", "chain_sum",
        "gcd"]
    # reasoning-gym: the generator's own score_answer of the <answer> text.
    for g in ("chain_sum", "gcd"):
        env = ReasoningGymEnv(g)
        for t in by_domain[g]:
            entry = env.dataset[int(t.task_id.rsplit("-", 1)[1])]
            answer = t.metadata["artifacts"]["answer"] or ""
            assert t.reward == env.dataset.score_answer(extract_answer(answer), entry)
    # verifiers: its rubric's score (ReasoningGymEnv's reward function) of the completion.
    vf_env = vf.ReasoningGymEnv(gym="lcm", num_train_examples=16, num_eval_examples=8)
    for t in by_domain["ReasoningGymEnv"]:
        record = json.loads(t.metadata["artifacts"]["answer"])
        entry = vf_env.rg_dataset[int(t.task_id.rsplit("-", 1)[1])]
        said = vf_env.parser.parse_answer([{"role": "assistant", "content": record["answer"]}])
        assert t.reward == record["reward"]
        assert t.reward == vf_env.rg_dataset.score_answer(str(said).strip(), entry)
    # TextArena: the game's own reward for the answers, one episode of them.
    for t in by_domain["GuessTheNumber-v0"]:
        answers = json.loads(t.metadata["artifacts"]["answer"])["answers"]
        game = ta.make(env_id="GuessTheNumber-v0")
        game.reset(num_players=1, seed=int(t.task_id.rsplit("-", 1)[1]))
        for a in answers:
            done, _ = game.step(a)
        assert done and t.reward == game.close()[0][0]
        (episode,) = t.episodes
        assert len(episode.completions) == len(answers) >= 2
    # Gymnasium: the env's own step rewards, summed over the actions the answers named.
    from ac2_jax.orchestration.gym_env import GymTextEnv

    lake = GymTextEnv("FrozenLake-v1", is_slippery=False)
    for t in by_domain["FrozenLake-v1"]:
        answers = json.loads(t.metadata["artifacts"]["answer"])["answers"]
        env = gym.make("FrozenLake-v1", is_slippery=False)
        env.reset(seed=int(t.task_id.rsplit("-", 1)[1]))
        total = 0.0
        for a in answers:
            action = lake.action_of(a)
            if action is None:
                break
            _, reward, terminated, truncated, _ = env.step(action)
            total += reward
            if terminated or truncated:
                break
        assert t.reward == total
        (episode,) = t.episodes
        assert len(episode.completions) == len(answers)
    # OpenEnv: the env's own step rewards for the answers, replayed from the task's seed;
    # max_turns=2 ended each episode after the env's second reply.
    sys.path.insert(0, str(tmp_path))
    try:
        from echo_env.models import EchoAction
        from echo_env.server.echo_env_environment import EchoEnvironment
    finally:
        sys.path.remove(str(tmp_path))
    for t in by_domain["EchoEnvironment"]:
        answers = json.loads(t.metadata["artifacts"]["answer"])["answers"]
        assert len(answers) == 2
        own = EchoEnvironment()
        own.reset(seed=int(t.task_id.rsplit("-", 1)[1]))
        assert t.reward == sum(own.step(EchoAction(message=a)).reward for a in answers)
        (episode,) = t.episodes
        assert len(episode.completions) == 2
    (mix,) = [json.loads(x) for x in open(run / "report" / "mix.jsonl")]
    assert sorted(mix["mix_weight"]) == sorted(by_domain)
    assert abs(sum(mix["mix_weight"].values()) - 1) < 1e-9
    assert os.path.getsize(run / "report" / "mix.png") > 1000
    assert json.load(open(run / "report" / "report.json"))["mix_jsonl"].endswith("mix.jsonl")
    assert json.load(open(run / "report" / "env_audit.json"))["flagged"] == []
