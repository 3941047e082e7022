"""Sandboxed tools: limits, crashes and secrets become tool errors; the loop goes on.

Each call starts a real child process. Elapsed times are checked only
loosely (limit + 10 s), never tightly.
"""

import asyncio
import functools
import json
import os
import signal
import time

import openai
import pytest

from ac2_jax.envs import Env, SandboxLimits, Task, Tool, run_tool
from ac2_jax.orchestration import DefaultOrchestrator, SingleTaskUser, run_task
from tests.support import sandbox_tools as st

SLACK_S = 10.0


def _tool(fn, **limits):
    return Tool("t", "test tool", {"type": "object"}, fn, timeout_s=30.0,
                sandbox=SandboxLimits(**limits))


def _run(tool, args=None):
    t0 = time.monotonic()
    text, ok = asyncio.run(run_tool(tool, args or {}))
    return text, ok, time.monotonic() - t0


def test_result_and_output_capture_with_cap():
    text, ok, _ = _run(_tool(st.add), {"a": 2, "b": 3})
    assert (text, ok) == ("5", True)
    text, ok, _ = _run(_tool(st.shout, output_bytes=1000), {"n": 100_000})
    assert ok and text.startswith("100000\n--- stdout ---\n" + "o" * 1000 + "\n")
    assert "[stdout cut: 99000 more bytes not shown]" in text
    assert "e" * 1000 + "\n[stderr cut: 99000 more bytes not shown]" in text
    assert "o" * 1001 not in text and "e" * 1001 not in text and len(text) < 2300


def test_cpu_limit_stops_an_endless_loop():
    text, ok, elapsed = _run(_tool(st.spin, cpu_s=1, wall_s=60))
    assert not ok and text.startswith("error: t: CPU time limit of 1s hit"), text
    assert elapsed < 1 + SLACK_S


def test_wall_limit_kills_the_whole_process_group(tmp_path):
    text, ok, elapsed = _run(_tool(st.sleep_forever, wall_s=1))
    assert not ok and text == "error: t: killed after the wall-time limit of 1s", text
    assert elapsed < 1 + SLACK_S
    pid_file = tmp_path / "grandchild.pid"
    text, ok, _ = _run(_tool(st.spawn_and_hang, wall_s=2), {"pid_file": str(pid_file)})
    assert not ok and "wall-time limit of 2s" in text
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + SLACK_S
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the tool's grandchild outlived the call"


def test_a_process_that_left_the_group_does_not_hold_the_call(tmp_path):
    """A grandchild in its own session survives the kill and keeps stdout open:
    the call still returns (within the wall limit + the pipes' grace + slack)."""
    pid_file = tmp_path / "escaped.pid"
    try:
        text, ok, elapsed = _run(_tool(st.escape_and_hang, wall_s=1), {"pid_file": str(pid_file)})
    finally:
        if pid_file.exists():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)  # the one process it started
    assert not ok and "wall-time limit of 1s" in text
    assert elapsed < 1 + 2 + SLACK_S


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def test_memory_limit_becomes_a_tool_error():
    text, ok, elapsed = _run(_tool(st.allocate, memory_mb=256), {"mb": 2048})
    assert not ok and text.startswith("error: t: memory limit of 256 MB hit (MemoryError"), text
    assert elapsed < 30 + SLACK_S
    text, ok, _ = _run(_tool(st.allocate, memory_mb=256), {"mb": 16})  # under it: fine
    assert (text, ok) == (str(16 * 1024 * 1024), True)


@pytest.mark.parametrize("fn,expected", [
    (st.abort, "error: t: the sandboxed tool was killed by SIGABRT"),
    (st.segfault, "error: t: the sandboxed tool was killed by SIGSEGV"),
    (st.exit3, "error: t: the sandboxed tool exited with status 3"),
    (st.raise_value, "error: t: ValueError: no such thing"),
])
def test_crashes_become_tool_errors(fn, expected):
    text, ok, elapsed = _run(_tool(fn))
    assert not ok and text.startswith(expected), text
    assert elapsed < 30 + SLACK_S


def test_limits_are_set_in_the_child_and_no_core_dumps():
    text, ok, _ = _run(_tool(st.limits, cpu_s=2.5, memory_mb=512))
    mb = 512 * 1024 * 1024
    assert ok and text == repr([(0, 0), (3, 4), (mb, mb)])


def test_secrets_are_not_visible_in_the_child(monkeypatch):
    monkeypatch.setenv("MY_API_KEY", "sk-secret")
    monkeypatch.setenv("HF_TOKEN", "hf-secret")
    monkeypatch.setenv("PLAIN_SETTING", "1")
    for name in ("MY_API_KEY", "HF_TOKEN", "PLAIN_SETTING"):
        assert _run(_tool(st.read_env), {"name": name})[:2] == ("None", True)
    allowed = _tool(st.read_env, env_allow=("PATH", "PLAIN_SETTING"))
    assert _run(allowed, {"name": "PLAIN_SETTING"})[:2] == ("'1'", True)
    with pytest.raises(ValueError, match="MY_API_KEY.*never reach"):
        SandboxLimits(env_allow=("PATH", "MY_API_KEY"))


def test_fresh_scratch_directory_is_cwd_and_home_and_is_removed():
    text, ok, _ = _run(_tool(st.where))
    cwd, home, written = text.split("|")
    assert ok and cwd == home and written == "True"
    assert not os.path.exists(cwd)
    assert _run(_tool(st.where))[0].split("|")[0] != cwd  # a new one per call


def test_unsendable_tools_and_bad_limits_are_refused():
    with pytest.raises(ValueError, match="picklable"):
        Tool("t", "", {"type": "object"}, lambda: 1, sandbox=SandboxLimits())
    with pytest.raises(ValueError, match="picklable"):
        Tool("t", "", {"type": "object"}, _local_tool(), sandbox=SandboxLimits())
    Tool("t", "", {"type": "object"}, functools.partial(st.add, a=1), sandbox=SandboxLimits())
    for bad in (dict(cpu_s=0), dict(wall_s=-1), dict(memory_mb=0), dict(output_bytes=0)):
        with pytest.raises(ValueError, match="SandboxLimits"):
            SandboxLimits(**bad)


def _local_tool():
    def inner():
        return 1
    return inner


class SandboxedEnv(Env):
    """Calculator-style: `add`, plus tools that crash or loop, all sandboxed."""

    def sample_tasks(self, n, seed, split="train"):
        return [Task(task_id=f"t{i}", prompt="What is 3 + 4?", answer=7) for i in range(n)]

    @property
    def tools(self):
        limits = SandboxLimits(cpu_s=1, wall_s=30)
        schema = {"type": "object"}
        return [Tool("add", "add two integers", schema, st.add, sandbox=limits),
                Tool("crash", "crashes", schema, st.segfault, sandbox=limits),
                Tool("spin", "loops forever", schema, st.spin, sandbox=limits)]

    def verify(self, task, answer):
        return float("7" in (answer or ""))


class ScriptedClient:
    """An AsyncOpenAI stand-in answering from a script: ("CALL name", args) or ("", text)."""

    def __init__(self, script):
        self.script, self.requests = list(script), []
        self.chat = self.completions = self

    async def create(self, *, model, messages, **kw):
        self.requests.append(list(messages))
        call, arg = self.script.pop(0)
        calls, content = None, arg
        if call:
            calls = [{"id": f"c{len(self.requests)}", "type": "function",
                      "function": {"name": call, "arguments": json.dumps(arg)}}]
            content = None
        return openai.types.chat.ChatCompletion.model_validate({
            "id": "x", "object": "chat.completion", "created": 0, "model": model,
            "choices": [{"index": 0, "finish_reason": "tool_calls" if call else "stop",
                         "logprobs": None, "message": {"role": "assistant", "content": content,
                                                       "tool_calls": calls}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}})


def test_rollout_goes_on_after_crashing_and_looping_tools_and_the_loop_stays_free():
    env = SandboxedEnv()
    client = ScriptedClient([("crash", {}), ("spin", {}), ("add", {"a": 3, "b": 4}),
                             ("", "The answer is 7.")])
    orch = DefaultOrchestrator(env, env.sample_tasks(1, 0)[0], client, "tiny")
    ticks = []

    async def ticker(stop):
        while not stop.is_set():
            ticks.append(time.monotonic())
            await asyncio.sleep(0.02)

    async def main():
        stop = asyncio.Event()
        tick = asyncio.ensure_future(ticker(stop))
        conv = await run_task(orch, SingleTaskUser())
        stop.set()
        await tick
        return conv

    conv = asyncio.run(main())
    assert conv.status == "finished" and env.verify(None, conv.answer) == 1.0
    assert conv.metrics["tool_calls"] == 3 and conv.metrics["tool_errors"] == 2
    results = [m["content"] for m in conv.messages if m["role"] == "tool"]
    assert results[0].startswith("error: crash: the sandboxed tool was killed by SIGSEGV")
    assert results[1].startswith("error: spin: CPU time limit of 1s hit")
    assert results[2] == "7"
    # The spin tool ran >= 1 s of CPU; the loop kept ticking all along: no gap as long as that
    # (a blocked loop would show one; the bound is loose for a loaded machine).
    assert ticks[-1] - ticks[0] >= 1.0 and max(b - a for a, b in zip(ticks, ticks[1:])) < 1.0
