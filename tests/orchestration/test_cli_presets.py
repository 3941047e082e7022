"""The agent CLI presets (Claude Code, Codex, Gemini CLI, Qwen Code, opencode) and the
"fix the tests" tasks (ac2_jax/orchestration/cli_presets.py).

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
    gemini_cli,
    opencode,
    qwen_code,
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
    claude = claude_code("claude")
    argv, env = claude.argv(launch), claude.environ(launch)
    assert argv[:3] == ["claude", "-p", "do it"] and "--model" in argv
    # Default settings: no --bare, no --tools, its own system prompt, no turn limit.
    assert not {"--bare", "--tools", "--system-prompt", "--max-turns"} & set(argv)
    assert "--bare" in claude_code("claude", bare=True, tools=("Bash",)).argv(launch)
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9"  # the SDK adds /v1/messages
    assert env["ANTHROPIC_API_KEY"] == "sk-rollout" and "sk-rollout" not in argv
    cx = codex("codex")
    argv, env = cx.argv(launch), cx.environ(launch)
    assert argv[-1] == "do it" and env == {"AC2_ROLLOUT_KEY": "sk-rollout"}
    assert any('base_url="http://127.0.0.1:9/v1"' in a for a in argv)
    # Default settings: its tools (web search, multi-agent) and base instructions kept.
    assert not any("web_search" in a or "multi_agent" in a for a in argv)
    assert not (tmp_path / "instructions.md").exists()
    codex("codex", instructions="Be brief.").argv(launch)
    assert (tmp_path / "instructions.md").read_text() == "Be brief."


def test_gemini_cli_qwen_code_and_opencode_point_at_the_rollout(tmp_path):
    from ac2_jax.orchestration.cli_agent import Launch

    launch = Launch("do it", "policy", "http://127.0.0.1:9/v1", "sk-rollout", str(tmp_path),
                    str(tmp_path))
    gem = gemini_cli("gemini")
    argv, env = gem.argv(launch), gem.environ(launch)
    assert argv[:3] == ["gemini", "-p", "do it"] and "sk-rollout" not in argv
    assert env["GOOGLE_GEMINI_BASE_URL"] == "http://127.0.0.1:9"  # it adds /v1beta/models/...
    assert env["GEMINI_API_KEY"] == "sk-rollout"
    settings = json.loads((tmp_path / ".gemini" / "settings.json").read_text())
    assert settings["security"]["auth"]["selectedType"] == "gemini-api-key"
    assert settings["telemetry"]["enabled"] is False and gem.api == "gemini"
    qwen = qwen_code("qwen")
    argv, env = qwen.argv(launch), qwen.environ(launch)
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1" and env["OPENAI_MODEL"] == "policy"
    assert json.loads((tmp_path / ".qwen" / "settings.json").read_text())["telemetry"] == {
        "enabled": False}
    assert {r["agent"] for r in qwen.agent_rules} == {"memory"}
    oc = opencode("opencode")
    argv, env = oc.argv(launch), oc.environ(launch)
    assert argv[:3] == ["opencode", "run", "do it"] and "ac2/policy" in argv
    config = json.loads(env["OPENCODE_CONFIG_CONTENT"])
    assert config["provider"]["ac2"]["options"] == {"baseURL": "http://127.0.0.1:9/v1",
                                                    "apiKey": "sk-rollout"}
    assert oc.agent_rules[0]["agent"] == "title"
    # The rules reach each attempt's rollout through the env.
    env_ = CLIAgentEnv(fix_the_tests_tasks(), oc, unittest_passes)
    assert env_.agent_rules == [dict(oc.agent_rules[0])]
    assert CLIAgentEnv(fix_the_tests_tasks(), codex(), unittest_passes).agent_rules is None


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


# npm package and the program it installs, per CLI (installed together on first use).
CLI_PACKAGES = {
    "claude-code": ("@anthropic-ai/claude-code", "claude"),
    "codex": ("@openai/codex", "codex"),
    "gemini-cli": ("@google/gemini-cli", "gemini"),
    "qwen-code": ("@qwen-code/qwen-code", "qwen"),
    "opencode": ("opencode-ai", "opencode"),
}
PRESETS = {"claude-code": claude_code, "codex": codex, "gemini-cli": gemini_cli,
           "qwen-code": qwen_code, "opencode": opencode}


@pytest.fixture(scope="module")
def cli_bin():
    """The bin directory of the five CLIs, installed from the npm registry on first use
    (a CLI whose package downloads a binary at install may fail here: its test is
    skipped naming why)."""
    if shutil.which("npm") is None or shutil.which("node") is None:
        pytest.skip("node/npm are not installed: the real CLI agents cannot run here")
    root = os.environ.get("AC2_CLI_AGENTS_DIR",
                          os.path.expanduser("~/.cache/ac2_jax/cli-agents"))
    bin_dir = os.path.join(root, "node_modules", ".bin")
    missing = [pkg for pkg, exe in CLI_PACKAGES.values()
               if not os.path.exists(os.path.join(bin_dir, exe))]
    if missing:
        os.makedirs(root, exist_ok=True)
        proc = subprocess.run(["npm", "install", "--prefix", root, "--no-audit", "--no-fund",
                               *missing], capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            pytest.skip(f"npm could not install {missing}: {proc.stderr[-500:]}")
    return bin_dir


def cli_exe(cli_bin, which):
    exe = os.path.join(cli_bin, CLI_PACKAGES[which][1])
    probe = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:  # e.g. a platform binary its install script did not fetch
        pytest.skip(f"{which} does not run here ({exe} --version: "
                    f"{(probe.stderr or probe.stdout)[-300:]})")
    return exe


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
    hidden = nnx.jit(lambda m, t, p, s: m.hidden_states(t, p, s))  # one program, not op by op
    h = np.asarray(hidden(model, tokens, np.arange(512, dtype=np.int32)[None],
                          np.ones_like(tokens)))[0]
    u = h.mean(0)
    head = np.asarray(model.lm_head[...]).copy()
    head[:, tok.eos_token_id] = 2.0 * u / (u @ u)
    model.lm_head[...] = head
    return model


def sampled_forward_logprobs(model, tokens, start, temperature, top_k, top_p, length,
                             window=256):
    """log p(tokens[i] | tokens[:i]) for i >= start under the sampling distribution
    (temperature, then top-k, then top-p: `losses.sampling_logits`, the sampled token
    kept) of one fp32 forward pass. A CLI that sends top_k / top_p (Gemini CLI: topK 64,
    topP 0.95) is served from the truncated distribution, and the sampler's log-probs are
    of that distribution.

    One program for every completion of a test: the forward runs over `length` tokens
    (the context; the rest padding) and the distribution over `window` positions from
    `start - 1` (>= the completion's tokens), with start,
    temperature, top_k and top_p as arguments. It is compiled at XLA's default codegen
    (the suite's -O0 runs this 6k-token forward ~8x slower: tests/conftest.py)."""
    import numpy as np

    n = len(tokens)
    assert n - start <= window and n <= length, (
        f"{n - start} output tokens (window {window}) and {n} in all (length {length})")
    t = np.zeros((1, length + window), np.int32)  # the window may run past the context
    t[0, :n] = tokens
    segs = np.zeros((1, length), np.int32)
    segs[0, :n] = 1
    pos = np.arange(length, dtype=np.int32)[None]
    args = (t, pos, segs, np.int32(start), np.float32(temperature),
            np.int32(max(int(top_k), 0)), np.float32(top_p))
    from flax import nnx

    graph, state = nnx.split(model)
    return np.asarray(_reference_program(graph, state, args, window)(state, *args))[: n - start]


_reference = {}


def _reference_program(graph, state, args, window):
    """The compiled reference (see `sampled_forward_logprobs`), one per model structure
    and shape (both narrowed tests' reference models share it)."""
    key = (graph, args[0].shape, window)
    if key not in _reference:
        import jax
        import jax.numpy as jnp
        from flax import nnx

        from ac2_jax.losses import sampling_logits

        length = args[1].shape[1]

        def logprobs(state, t, pos, segs, start, temperature, top_k, top_p):
            logits = nnx.merge(graph, state)(t[:, :length], pos, segs).astype("float32")[0]
            logits = jnp.pad(logits, ((0, window), (0, 0)))
            rows = jax.lax.dynamic_slice_in_dim(logits, start - 1, window)
            targets = jax.lax.dynamic_slice_in_dim(t[0], start, window)
            lg = sampling_logits(rows, temperature, top_k, top_p, keep=targets)
            lp = jax.nn.log_softmax(lg, axis=-1)
            return jnp.take_along_axis(lp, targets[:, None], axis=-1)[:, 0]

        compiled = jax.jit(logprobs).lower(state, *args).compile(compiler_options={
            "xla_backend_optimization_level": 2, "xla_cpu_use_fusion_emitters": True})
        _reference[key] = compiled
    return _reference[key]


def final_text(agent_name: str, result: CLIResult) -> str:
    """What the agent answered: Claude Code's JSON `result`, else its output."""
    if agent_name == "claude-code":
        return str(json.loads(result.stdout).get("result") or "")
    return result.stdout.strip()


# One RL step per CLI at its default prompts' length (a 65,536-token context on CPU) is
# 150-820 s of CPU each (CLI processes included) at XLA's default codegen, which
# tests/conftest.py gives these runs (at the suite's -O0 their attention is 5-15x slower;
# docs/notes/2026-12-07-default-settings-cli-rl-steps.md): more than the suite's budget for five.
RL_STEP_OPT_IN = "AC2_CLI_RL_STEP"
# The narrowed settings (small prompts) that keep one RL step per API in the full tier:
# Claude Code bare with one tool and a short system prompt; Codex with short
# instructions and without its multi-agent group and web search.
NARROWED = {
    "claude-code": lambda exe: claude_code(
        exe, bare=True, tools=("Bash",), max_turns=8,
        system_prompt="You are a coding agent. Work in the current directory."),
    "codex": lambda exe: codex(
        exe, instructions="You are a coding agent. Use exec_command to run shell commands.",
        config=('web_search="disabled"', "features.multi_agent=false", "features.goals=false",
                'model_reasoning_summary="none"')),
}
# Their context: the narrowed prompts are ~1.6k tiny tokens (Claude Code) and ~4.8k
# (Codex), plus 64 sampled. Both CLIs train batches of the same shape (8 rows of 6,144:
# a Codex row holds one attempt), so the second reuses the first's compiled programs
# (this file runs at XLA's default codegen, where compiling costs more than running).
NARROWED_CONTEXT, NARROWED_ROWS = 6144, 8


@pytest.mark.parametrize("which", list(CLI_PACKAGES))
def test_one_rl_step_from_real_cli_agent_rollouts(tmp_path, cli_bin, which):
    """Attempts by the real CLI with its default settings (only base URL, key, model
    and telemetry/update switches set) through /v1/messages (Claude Code),
    /v1/responses (Codex), the Gemini API (Gemini CLI) or /v1/chat/completions (Qwen
    Code, opencode), then one RL step (`rl_step`). Their default prompts are 18k-48k
    tokens of the tiny tokenizer, so the model is served with a 65,536-token context.
    Opt-in (AC2_CLI_RL_STEP=1): see RL_STEP_OPT_IN."""
    if os.environ.get(RL_STEP_OPT_IN) != "1":
        pytest.skip(f"one RL step at a 65,536-token context takes many minutes per CLI on "
                    f"CPU; set {RL_STEP_OPT_IN}=1 to run it (the tool round trip per CLI runs "
                    "by default: test_each_cli_runs_the_tool_call_the_model_served)")
    # rows=1: the batch grows to the rows its 4 long segments need (2-4), not 8 of
    # 65,536 tokens, half of them padding.
    rl_step(tmp_path, which, PRESETS[which](cli_exe(cli_bin, which)), 65536, attempts=4,
            rows=1)


@pytest.mark.parametrize("which", list(NARROWED))
def test_one_rl_step_from_narrowed_cli_agent_rollouts(tmp_path, cli_bin, which):
    """Eight attempts by Claude Code / Codex with `NARROWED` settings, one RL step, in
    `NARROWED_ROWS` rows (not 16, half of them padding)."""
    rl_step(tmp_path, which, NARROWED[which](cli_exe(cli_bin, which)), NARROWED_CONTEXT,
            attempts=8, rows=NARROWED_ROWS)


def rl_step(tmp_path, which, agent, context, attempts, rows=None):
    """`attempts` attempts of one task by `agent`, graded by parity of the final answer's
    length (a random policy earns it about half the time, so the group has a signal but
    for a tie, which is then a counted no-signal step), then one RL step. Every served
    token is recorded with the sampler's log-prob, and that log-prob is what a forward
    pass of the sampling weights gives (fp32, 1e-4): the tokens are trained exactly as
    sampled. Side conversations carry their own agent label (`agent.agent_rules`).
    rows: the batch's minimum rows (`BatchConfig.rows`; default 2 x attempts)."""
    import numpy as np

    from ac2_jax import recipes
    from ac2_jax.models import DecoderConfig
    from ac2_jax.recipes import RLRecipeConfig
    from ac2_jax.recipes.config import LogConfig, PathsConfig, RolloutConfig, SamplerConfig
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
    from ac2_jax.training import RLConfig
    from ac2_jax.training.rl import BatchConfig

    tok = build_tiny_tokenizer(str(tmp_path / "tok"), vocab_size=512)
    cfg = DecoderConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                        num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16,
                        max_position_embeddings=context, tie_embeddings=False)
    model, reference = short_answer_model(cfg, tok), short_answer_model(cfg, tok)
    tasks = [Task("hello", "Say hello in one word."),
             Task("bye", "Say goodbye in one word.", metadata={"split": "eval"})]
    env = CLIAgentEnv(tasks, agent,
                      lambda task, workdir, r: float(len(final_text(which, r)) % 2 == 0),
                      timeout_s=600)
    config = RLRecipeConfig(
        paths=PathsConfig(workdir=str(tmp_path / "run")),
        rl=RLConfig(steps=1, tasks_per_step=1, attempts_per_task=attempts,
                    concurrency=attempts, batch=BatchConfig(rows=rows or 2 * attempts,
                                      seq_len=context)),
        rollout=RolloutConfig(max_tokens=64, max_steps=1),
        sampler=SamplerConfig(max_context=context, warmup=False, model_name="tiny"),
        # No curve, trace pages or TensorBoard files (tests/test_first_day.py checks them).
        log=LogConfig(report_files=False, tensorboard=False),
    )
    result = recipes.rl((model, tok), env, config)
    traces = TraceStore(str(tmp_path / "run" / "traces" / "rollouts.jsonl")).read()
    assert len(traces) == attempts and all(t.status == "finished" for t in traces), [
        (t.status, t.metadata.get("artifacts", {}).get("error")) for t in traces]
    rewards = [t.reward for t in traces]
    (step,) = [json.loads(x) for x in open(tmp_path / "run" / "metrics" / "metrics.jsonl")]
    print(f"{which}: rewards {rewards}, grad_norm {step.get('train/grad_norm')}")
    if len(set(rewards)) > 1:  # a group with a signal trains
        assert step["train/skipped_update"] == 0.0 and step["train/grad_norm"] > 0
    else:
        assert step["train/skipped_update"] == 1.0
    labels = {e.agent for t in traces for e in t.episodes}
    assert "main" in labels and labels <= {"main", *(r["agent"] for r in agent.agent_rules)}
    served, max_err = 0, 0.0
    for trace in traces:
        for ep in trace.episodes:
            for c in ep.completions:
                ref = sampled_forward_logprobs(reference, c.prompt_ids + c.output_ids,
                                               len(c.prompt_ids), c.temperature, c.top_k,
                                               c.top_p, context)
                np.testing.assert_allclose(c.output_logprobs, ref, atol=1e-4)
                max_err = max(max_err, float(np.abs(np.asarray(c.output_logprobs) - ref).max()))
                served += len(c.output_ids)
    print(f"{which}: {served} served tokens, max |sampler - forward| log-prob {max_err:.1e}")
    assert served > 0
    assert result.report["steps"] == 1


# ------------------------------------------------------------------ a served tool call

MARK = "marker-67"
# Each CLI's shell tool and its arguments (from their default requests,
# docs/notes/2026-12-07-production-agent-clis-default-settings.md).
SHELL_CALLS = [("exec_command", {"cmd": f"echo {MARK} | tee made_by_tool.txt"}),
               ("Bash", {"command": f"echo {MARK} | tee made_by_tool.txt"}),
               ("run_shell_command", {"command": f"echo {MARK} | tee made_by_tool.txt"}),
               ("bash", {"command": f"echo {MARK} | tee made_by_tool.txt",
                         "description": "Write the file"})]


class ToolCallingSampler:
    """The Sampler protocol over a script: while the prompt offers one of `SHELL_CALLS`'
    tools and the command's output has not come back (MARK once: the call itself), it
    answers the call (Hermes format); then "done". A test double of the policy only:
    the endpoint, the CLI and its tool run for real."""

    def __init__(self, tok, max_context: int = 65536):
        self.tok, self.max_context, self.policy_version = tok, max_context, 0

    def load_weights(self, step=None):
        return self.policy_version

    async def generate(self, prompt_ids, params, *, on_tokens=None):
        from ac2_jax.sampling import SampleResult

        prompt = self.tok.decode(prompt_ids)
        text = "done"
        if prompt.count(MARK) < 2:
            for name, args in SHELL_CALLS:
                if f'"name": "{name}"' in prompt:
                    call = json.dumps({"name": name, "arguments": args})
                    text = f"<tool_call>\n{call}\n</tool_call>"
                    break
        out = (self.tok.encode(text) + [self.tok.eos_token_id])[: params.max_tokens]
        if on_tokens is not None:
            on_tokens(out, [-0.5] * len(out))
        return SampleResult(out, [-0.5] * len(out), "stop", self.policy_version)


@pytest.mark.parametrize("which", list(CLI_PACKAGES))
def test_each_cli_runs_the_tool_call_the_model_served(tmp_path, cli_bin, which):
    """A full tool round trip with each CLI's default settings: the served model calls
    the CLI's shell tool, the CLI runs it in its directory, and the result comes back
    in the same episode (the second prompt extends the first prompt + its output)."""
    import asyncio

    import httpx

    from ac2_jax.orchestration.cli_agent import Launch, run_cli
    from ac2_jax.serving.app import build_app
    from ac2_jax.serving.server import serve_in_thread
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer

    agent = PRESETS[which](cli_exe(cli_bin, which))
    tok = build_tiny_tokenizer(str(tmp_path / "tok"))
    url, stop = serve_in_thread(build_app(ToolCallingSampler(tok), tok, admin_key="sk-a",
                                          model_name="tiny", default_max_tokens=256))
    admin = {"Authorization": "Bearer sk-a"}
    try:
        info = httpx.post(url + "/v1/rollouts", headers=admin, json={
            "task_id": which, "agent_rules": list(agent.agent_rules) or None}).json()
        workdir, home = tmp_path / "work", tmp_path / "home"
        workdir.mkdir()
        home.mkdir()
        launch = Launch("Write the file.", "tiny", info["base_url"], info["api_key"],
                        str(workdir), str(home))
        result = asyncio.run(run_cli(agent, launch, 300))
        trace = httpx.get(f"{url}/v1/rollouts/{info['rollout_id']}/trace", headers=admin).json()
    finally:
        stop()
    assert (workdir / "made_by_tool.txt").read_text().strip() == MARK, (
        result.exit_code, result.stdout[-1500:], result.stderr[-1500:])
    main = [e for e in trace["episodes"] if e["agent"] == "main"]
    assert any(len(e["completions"]) >= 2 for e in main), [
        (e["agent"], len(e["completions"])) for e in trace["episodes"]]
    for e in main:
        comps = e["completions"]
        for a, b in zip(comps, comps[1:], strict=False):
            assert b["prompt_ids"][:len(a["prompt_ids"]) + len(a["output_ids"])] == (
                a["prompt_ids"] + a["output_ids"])
    assert agent.outcome(result) == "finished", (result.stdout[-800:], result.stderr[-800:])
