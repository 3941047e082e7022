"""Command-line agents as harnesses (ac2_jax/orchestration/cli_agent.py).

Every test runs a real program as a subprocess against the real endpoint
(FastAPI over HTTP, a tiny random model behind a JaxSampler): a small Python
agent written here that speaks the API through the official `openai` SDK.
It checks the harness's plumbing: the scratch directory, base URL and key,
the verifier on the directory, outcomes (finished, the agent's own step
limit, failures, timeouts) and that nothing the program started outlives it.
The real Claude Code and Codex CLIs are in test_cli_presets.py.
"""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
import time

import pytest

from ac2_jax.envs import Task
from ac2_jax.orchestration import LifecycleClient, run_rollout
from ac2_jax.orchestration.cli_agent import CLIAgent, CLIAgentEnv, CLIResult
from tests.support.serving_helpers import served_random_model

ADMIN = "sk-admin-cli"

AGENT_PY = textwrap.dedent('''
    """A small command-line agent: asks the model once, writes its answer to answer.txt."""
    import os, sys, time

    prompt = sys.argv[1]
    if os.environ.get("AGENT_MODE") == "fail":
        print("agent: giving up", file=sys.stderr)
        sys.exit(3)
    if os.environ.get("AGENT_MODE") in ("hang", "background"):
        child = os.fork()
        if child == 0:
            time.sleep(600)
            os._exit(0)
        open("child.pid", "w").write(str(child))
        if os.environ["AGENT_MODE"] == "hang":
            time.sleep(600)
    import openai  # after the modes that never ask: a hung agent writes child.pid at once

    client = openai.OpenAI(base_url=os.environ["AGENT_BASE_URL"],
                           api_key=os.environ["AGENT_API_KEY"], max_retries=0)
    resp = client.chat.completions.create(model=os.environ["AGENT_MODEL"], max_tokens=8,
                                          messages=[{"role": "user", "content": prompt}])
    with open("answer.txt", "w") as f:
        f.write(resp.choices[0].message.content or "")
    print(resp.choices[0].message.content)
    if os.environ.get("AGENT_MODE") == "limit":
        print("turn limit reached")
        sys.exit(1)
''')


def limit_outcome(result: CLIResult) -> str:
    """The agent ran out of its own turns: it says so and exits 1."""
    if result.exit_code == 1 and "turn limit reached" in result.stdout:
        return "step_limit"
    return "finished" if result.exit_code == 0 else "error"


def python_agent(script: str, mode: str = "ok") -> CLIAgent:
    return CLIAgent(
        "python-agent", "chat",
        argv=lambda launch: [sys.executable, script, launch.prompt],
        environ=lambda launch: {"AGENT_BASE_URL": launch.base_url, "AGENT_API_KEY": launch.api_key,
                                "AGENT_MODEL": launch.model, "AGENT_MODE": mode,
                                "PYTHONPATH": os.pathsep.join(sys.path)},
        outcome=limit_outcome)


def answer_is_even(task: Task, workdir: str, result: CLIResult) -> float:
    """The parity verifier (a random policy earns it about half the time)."""
    with open(os.path.join(workdir, "answer.txt")) as f:
        return float(len(f.read()) % 2 == 0)


def one_task(files=None) -> list[Task]:
    return [Task(task_id="t0", prompt="Say a word.", metadata={"files": files or {}}),
            Task(task_id="e0", prompt="Say a word.", metadata={"split": "eval"})]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """The endpoint every test's agent talks to (one per module: one compile)."""
    with served_random_model(tmp_path_factory.mktemp("cli_endpoint"), ADMIN) as (url, _tok):
        yield url


async def attempt(url, env, task, timeout_s=None):
    lifecycle = LifecycleClient(url, ADMIN)
    try:
        return await run_rollout(lifecycle, env, task, lambda e, t, c, m: e.make_harness(t, c, m),
                                 "tiny", timeout_s=timeout_s)
    finally:
        await lifecycle.aclose()


def test_a_program_speaking_the_api_is_a_harness(url, tmp_path):
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
    trace, conv = asyncio.run(attempt(url, env, env.tasks[0]))
    assert trace.status == "finished", trace.metadata
    assert seen["cwd_is_scratch"] and seen["files"] == [".home", "answer.txt", "notes"]
    assert trace.reward in (0.0, 1.0)
    (episode,) = trace.episodes  # the program's one request, recorded under its rollout
    assert len(episode.completions) == 1 and episode.agent == "main"
    assert conv.metrics["cli_exit_code"] == 0
    assert os.listdir(tmp_path / "scratch") == []  # graded, then removed


def test_a_failing_program_is_ours_and_a_hung_one_is_killed(url, tmp_path):
    script = tmp_path / "agent.py"
    script.write_text(AGENT_PY)
    keep = tmp_path / "keep"
    keep.mkdir()
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


def test_the_agents_own_step_limit_is_graded_and_nothing_it_started_outlives_it(
        url, tmp_path, monkeypatch):
    """A program that hits its own turn limit (exit 1, saying so) ends as agent_error
    with its directory graded, like the tool loop's step limit; a program that
    leaves a child running has it killed when it exits; a relative scratch root
    works."""
    script = tmp_path / "agent.py"
    script.write_text(AGENT_PY)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scratch").mkdir()
    limit = CLIAgentEnv(one_task(), python_agent(str(script), "limit"), answer_is_even,
                        timeout_s=60, scratch_root="scratch")
    trace, conv = asyncio.run(attempt(url, limit, limit.tasks[0]))
    assert trace.status == "agent_error" and trace.reward in (0.0, 1.0)  # graded
    assert conv.metrics["cli_exit_code"] == 1
    assert os.listdir(tmp_path / "scratch") == []

    bg = CLIAgentEnv(one_task(), python_agent(str(script), "background"), answer_is_even,
                     timeout_s=60, scratch_root="scratch", keep_dirs=True)
    trace, _ = asyncio.run(attempt(url, bg, bg.tasks[0]))
    assert trace.status == "finished", trace.metadata["artifacts"]
    (workdir,) = list((tmp_path / "scratch").iterdir())
    child = int((workdir / "child.pid").read_text())
    for _ in range(50):
        if not alive(child):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"child {child} the agent left running outlived it")


def test_task_files_stay_inside_the_scratch_directory(tmp_path):
    env = CLIAgentEnv(one_task(), python_agent("unused"), answer_is_even)
    for bad in ("../escape.txt", "/etc/escape", "", "a/../../escape"):
        with pytest.raises(ValueError, match="outside the directory"):
            env.setup(Task("x", "p", metadata={"files": {bad: "no"}}), str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_task_that_cannot_be_set_up_leaves_no_directory(url, tmp_path):
    (tmp_path / "scratch").mkdir()
    bad = Task("t0", "p", metadata={"files": {"../escape.txt": "no"}})
    env = CLIAgentEnv([bad, Task("e0", "p", metadata={"split": "eval"})],
                      python_agent("unused"), answer_is_even,
                      scratch_root=str(tmp_path / "scratch"))
    trace, _ = asyncio.run(attempt(url, env, bad))
    assert trace.status == "infra_error" and "outside the directory" in str(
        trace.metadata["artifacts"]["error"])
    assert os.listdir(tmp_path / "scratch") == []
