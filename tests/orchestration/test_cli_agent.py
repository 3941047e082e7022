"""Command-line agents as harnesses (ac2_jax/orchestration/cli_agent.py).

Every test runs a real program as a subprocess against the real endpoint
(FastAPI over HTTP, a tiny random model behind a JaxSampler):
- a small Python agent written here that speaks the API through the official
  SDKs (always runs): the harness's plumbing (scratch directory, base URL
  and key, verifier on the directory, failures and timeouts);
- the real Claude Code and Codex CLIs, installed from the npm registry into a
  cache directory on first use (`AC2_CLI_AGENTS_DIR`, default
  ~/.cache/ac2_jax/cli-agents); skipped with a message saying why where
  `npm` is missing or the install fails. One RL step is trained from their
  rollouts: every token they were served is in the batch exactly as sampled
  (the learner's log-probs at the sampling weights equal the sampler's).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
from serving_helpers import served_random_model

from ac2_jax.envs import Task
from ac2_jax.orchestration import LifecycleClient, run_rollout
from ac2_jax.orchestration.cli_agent import (
    CLIAgent,
    CLIAgentEnv,
    CLIResult,
    claude_code,
    codex,
    fix_the_tests_tasks,
    unittest_passes,
)
from ac2_jax.trace import TraceStore

ADMIN = "sk-admin-cli"

AGENT_PY = textwrap.dedent('''
    """A small command-line agent: asks the model once, writes its answer to answer.txt."""
    import os, sys, time
    import openai

    prompt = sys.argv[1]
    if os.environ.get("AGENT_MODE") == "fail":
        print("agent: giving up", file=sys.stderr)
        sys.exit(3)
    if os.environ.get("AGENT_MODE") == "hang":
        child = os.fork()
        if child == 0:
            time.sleep(600)
        open("child.pid", "w").write(str(child))
        time.sleep(600)
    client = openai.OpenAI(base_url=os.environ["AGENT_BASE_URL"],
                           api_key=os.environ["AGENT_API_KEY"], max_retries=0)
    resp = client.chat.completions.create(model=os.environ["AGENT_MODEL"], max_tokens=8,
                                          messages=[{"role": "user", "content": prompt}])
    with open("answer.txt", "w") as f:
        f.write(resp.choices[0].message.content or "")
    print(resp.choices[0].message.content)
''')


def python_agent(script: str, mode: str = "ok") -> CLIAgent:
    return CLIAgent(
        "python-agent", "chat",
        argv=lambda launch: [sys.executable, script, launch.prompt],
        environ=lambda launch: {"AGENT_BASE_URL": launch.base_url, "AGENT_API_KEY": launch.api_key,
                                "AGENT_MODEL": launch.model, "AGENT_MODE": mode,
                                "PYTHONPATH": os.pathsep.join(sys.path)})


def answer_is_even(task: Task, workdir: str, result: CLIResult) -> float:
    """The parity verifier (a random policy earns it about half the time)."""
    with open(os.path.join(workdir, "answer.txt")) as f:
        return float(len(f.read()) % 2 == 0)


def one_task(files=None) -> list[Task]:
    return [Task(task_id="t0", prompt="Say a word.", metadata={"files": files or {}}),
            Task(task_id="e0", prompt="Say a word.", metadata={"split": "eval"})]


async def attempt(url, env, task, timeout_s=None):
    lifecycle = LifecycleClient(url, ADMIN)
    try:
        return await run_rollout(lifecycle, env, task, lambda e, t, c, m: e.make_harness(t, c, m),
                                 "tiny", timeout_s=timeout_s)
    finally:
        await lifecycle.aclose()


def test_a_program_speaking_the_api_is_a_harness(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(AGENT_PY)
    seen = {}

    def check(task, workdir, result):
        seen["files"] = sorted(os.listdir(workdir))
        seen["cwd_is_scratch"] = workdir.startswith(str(tmp_path / "scratch"))
        return answer_is_even(task, workdir, result)

    (tmp_path / "scratch").mkdir()
    env = CLIAgentEnv(one_task({"notes/task.md": "say a word"}), python_agent(str(script)), check,
                      timeout_s=60, scratch_root=str(tmp_path / "scratch"))
    with served_random_model(tmp_path, ADMIN) as (url, _tok):
        trace, conv = asyncio.run(attempt(url, env, env.tasks[0]))
    assert trace.status == "finished", trace.metadata
    assert seen["cwd_is_scratch"] and seen["files"] == [".home", "answer.txt", "notes"]
    assert trace.reward in (0.0, 1.0)
    (episode,) = trace.episodes  # the program's one request, recorded under its rollout
    assert len(episode.completions) == 1 and episode.agent == "main"
    assert conv.metrics["cli_exit_code"] == 0
    assert os.listdir(tmp_path / "scratch") == []  # graded, then removed


def test_a_failing_program_is_ours_and_a_hung_one_is_killed(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(AGENT_PY)
    keep = tmp_path / "keep"
    keep.mkdir()
    with served_random_model(tmp_path, ADMIN) as (url, _tok):
        fail = CLIAgentEnv(one_task(), python_agent(str(script), "fail"), answer_is_even,
                           timeout_s=60)
        trace, _ = asyncio.run(attempt(url, fail, fail.tasks[0]))
        assert trace.status == "infra_error" and trace.reward is None  # never trained
        assert "exited with status 3" in trace.metadata["artifacts"]["error"]
        assert "giving up" in trace.metadata["artifacts"]["error"]

        hang = CLIAgentEnv(one_task(), python_agent(str(script), "hang"), answer_is_even,
                           timeout_s=3, scratch_root=str(keep), keep_dirs=True)
        trace, _ = asyncio.run(attempt(url, hang, hang.tasks[0]))
    assert trace.status == "infra_error" and trace.reward is None
    (workdir,) = list(keep.iterdir())
    child = int((workdir / "child.pid").read_text())
    for _ in range(50):  # the whole process group was killed: the forked child too
        if not alive(child):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"child {child} of the timed-out agent is still alive")


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_fix_the_tests_tasks_are_graded_by_their_tests(tmp_path):
    tasks = fix_the_tests_tasks()
    env = CLIAgentEnv(tasks, python_agent("unused"), unittest_passes)
    assert {t.metadata["split"] for t in tasks} == {"train", "eval"}
    for task in tasks:
        d = tmp_path / task.task_id
        d.mkdir()
        env.setup(task, str(d))
        result = CLIResult(str(d), 0, "", "", 0.0)
        assert unittest_passes(task, str(d), result) == 0.0  # the bug shows
        code = (d / "calc.py").read_text()
        fixed = {"a - b": "a + b", "a + b": "a * b", "return a\n": "return -a\n",
                 "a * 2": "a * a"}
        for bad, good in fixed.items():
            if bad in code:
                (d / "calc.py").write_text(code.replace(bad, good))
                break
        assert unittest_passes(task, str(d), result) == 1.0, task.task_id
    with pytest.raises(ValueError, match="outside the directory"):
        env.setup(Task("x", "p", metadata={"files": {"../escape.txt": "no"}}), str(tmp_path / "x"))


# ------------------------------------------------------------------------ real CLIs


@pytest.fixture(scope="module")
def cli_bin():
    """The bin directory of @anthropic-ai/claude-code and @openai/codex, installed
    from the npm registry on first use."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("node/npm are not installed: the real CLI agents cannot run here")
    root = os.environ.get("AC2_CLI_AGENTS_DIR",
                          os.path.expanduser("~/.cache/ac2_jax/cli-agents"))
    bin_dir = os.path.join(root, "node_modules", ".bin")
    if not all(os.path.exists(os.path.join(bin_dir, b)) for b in ("claude", "codex")):
        os.makedirs(root, exist_ok=True)
        proc = subprocess.run(["npm", "install", "--prefix", root, "--no-audit", "--no-fund",
                               "@anthropic-ai/claude-code", "@openai/codex"],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            pytest.skip(f"npm could not install the CLI agents: {proc.stderr[-500:]}")
    return bin_dir


def short_answer_model(cfg, tok):
    """A tiny random Decoder whose answers end: the EOS column of its lm_head points
    along the mean final hidden state, so EOS has about 0.09 of the mass per token
    (median 0.02) and answers run a few dozen tokens. A CLI agent treats an answer
    cut at the token limit as an error; a random model would never stop."""
    import numpy as np
    from flax import nnx

    from ac2_jax.models import Decoder

    model = Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, tok.vocab_size, (1, 512)).astype(np.int32)
    h = np.asarray(model.hidden_states(tokens, np.arange(512, dtype=np.int32)[None],
                                       np.ones_like(tokens)))[0]
    u = h.mean(0)
    head = np.asarray(model.lm_head[...]).copy()
    head[:, tok.eos_token_id] = 2.0 * u / (u @ u)
    model.lm_head[...] = head
    return model


def final_text(agent_name: str, result: CLIResult) -> str:
    """What the agent answered: Claude Code's JSON `result`, Codex's last message."""
    if agent_name == "claude-code":
        return str(json.loads(result.stdout).get("result") or "")
    return result.stdout.strip()


@pytest.mark.parametrize("which", ["claude-code", "codex"])
def test_one_rl_step_from_real_cli_agent_rollouts(tmp_path, cli_bin, which):
    """Eight attempts by the real CLI through /v1/messages (Claude Code) or
    /v1/responses (Codex), graded by parity of the final answer's length (a
    random policy earns it about half the time, so the group has a signal but for
    a 1-in-128 tie, which is then a counted no-signal step), then
    one RL step. Every served token is recorded with the sampler's log-prob, and
    that log-prob is what a forward pass of the sampling weights gives (fp32,
    1e-4): the tokens are trained exactly as sampled."""
    import numpy as np
    from serving_helpers import forward_logprobs

    from ac2_jax import recipes
    from ac2_jax.models import DecoderConfig
    from ac2_jax.models.tiny_tokenizer import build_tiny_tokenizer
    from ac2_jax.recipes import RLRecipeConfig
    from ac2_jax.recipes.config import PathsConfig, RolloutConfig, SamplerConfig
    from ac2_jax.training import RLConfig
    from ac2_jax.training.rl import BatchConfig

    context = 6144
    tok = build_tiny_tokenizer(str(tmp_path / "tok"), vocab_size=512)
    cfg = DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                        max_position_embeddings=context, tie_embeddings=False)
    model, reference = short_answer_model(cfg, tok), short_answer_model(cfg, tok)
    exe = os.path.join(cli_bin, "claude" if which == "claude-code" else "codex")
    agent = claude_code(exe, tools=("Bash",)) if which == "claude-code" else codex(exe)
    tasks = [Task("hello", "Say hello in one word."),
             Task("bye", "Say goodbye in one word.", metadata={"split": "eval"})]
    env = CLIAgentEnv(tasks, agent,
                      lambda task, workdir, r: float(len(final_text(which, r)) % 2 == 0),
                      timeout_s=240)
    config = RLRecipeConfig(
        paths=PathsConfig(workdir=str(tmp_path / "run")),
        rl=RLConfig(steps=1, tasks_per_step=1, attempts_per_task=8, concurrency=8,
                    batch=BatchConfig(rows=16, seq_len=context)),
        rollout=RolloutConfig(max_tokens=64, max_steps=1),
        sampler=SamplerConfig(max_context=context, warmup=False, model_name="tiny"),
    )
    result = recipes.rl((model, tok), env, config)
    traces = TraceStore(str(tmp_path / "run" / "traces" / "rollouts.jsonl")).read()
    assert len(traces) == 8 and all(t.status == "finished" for t in traces), [
        (t.status, t.metadata.get("artifacts", {}).get("error")) for t in traces]
    rewards = [t.reward for t in traces]
    (step,) = [json.loads(x) for x in open(tmp_path / "run" / "metrics" / "metrics.jsonl")]
    print(f"{which}: rewards {rewards}, grad_norm {step.get('train/grad_norm')}")
    if len(set(rewards)) > 1:  # a group with a signal trains
        assert step["train/skipped_update"] == 0.0 and step["train/grad_norm"] > 0
    else:
        assert step["train/skipped_update"] == 1.0
    served = 0
    for trace in traces:
        for ep in trace.episodes:
            for c in ep.completions:
                ref = forward_logprobs(reference, c.prompt_ids + c.output_ids, bucket=1024)
                np.testing.assert_allclose(c.output_logprobs, ref[len(c.prompt_ids):],
                                           atol=1e-4)
                served += len(c.output_ids)
    assert served > 0
    assert result.report["steps"] == 1
