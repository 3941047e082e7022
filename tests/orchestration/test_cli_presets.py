"""The Claude Code and Codex presets and the "fix the tests" tasks
(ac2_jax/orchestration/cli_presets.py).

The real CLIs are installed from the npm registry into a cache directory on
first use (`AC2_CLI_AGENTS_DIR`, default ~/.cache/ac2_jax/cli-agents); their
tests are skipped with a message saying why where `npm` is missing or the
install fails. One RL step is trained from their rollouts through the real
endpoint: every token they were served is in the trace exactly as sampled
(the sampler's log-probs equal a forward pass of the sampling weights).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from ac2_jax.envs import Task
from ac2_jax.orchestration.cli_agent import CLIAgentEnv, CLIResult
from ac2_jax.orchestration.cli_presets import (
    claude_code,
    codex,
    fix_the_tests_tasks,
    unittest_passes,
)
from ac2_jax.trace import TraceStore


def test_claude_codes_turn_limit_is_its_step_limit():
    agent = claude_code()
    result = {"type": "result", "subtype": "error_max_turns", "is_error": True}
    assert agent.outcome(CLIResult(".", 1, json.dumps(result) + "\n", "", 0.0)) == "step_limit"
    api_error = {"type": "result", "subtype": "success", "is_error": True,
                 "api_error_status": 400}
    assert agent.outcome(CLIResult(".", 1, json.dumps(api_error), "", 0.0)) == "error"
    assert agent.outcome(CLIResult(".", 1, "not json", "", 0.0)) == "error"
    assert agent.outcome(CLIResult(".", 0, json.dumps({"subtype": "success"}), "", 0.0)) == (
        "finished")


def test_codex_and_claude_code_argv_point_at_the_rollout(tmp_path):
    from ac2_jax.orchestration.cli_agent import Launch

    launch = Launch("do it", "policy", "http://127.0.0.1:9/v1", "sk-rollout", str(tmp_path),
                    str(tmp_path))
    claude = claude_code("claude", tools=("Bash",))
    argv, env = claude.argv(launch), claude.environ(launch)
    assert argv[:3] == ["claude", "-p", "do it"] and "--model" in argv
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9"  # the SDK adds /v1/messages
    assert env["ANTHROPIC_API_KEY"] == "sk-rollout" and "sk-rollout" not in argv
    cx = codex("codex")
    argv, env = cx.argv(launch), cx.environ(launch)
    assert argv[-1] == "do it" and env == {"AC2_ROLLOUT_KEY": "sk-rollout"}
    assert any('base_url="http://127.0.0.1:9/v1"' in a for a in argv)
    assert (tmp_path / "instructions.md").exists()


def test_fix_the_tests_tasks_are_graded_by_their_tests(tmp_path):
    tasks = fix_the_tests_tasks()
    env = CLIAgentEnv(tasks, claude_code(), unittest_passes)
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
