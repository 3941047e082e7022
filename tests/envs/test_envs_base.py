"""run_tool: results, and every failure as text (never an exception)."""

import asyncio
import time

from ac2_jax.envs import Tool, run_tool


def _tool(fn, timeout_s=1.0):
    return Tool("t", "test tool", {"type": "object"}, fn, timeout_s=timeout_s)


def test_results_and_failures_become_text():
    add = _tool(lambda a, b: a + b)
    assert asyncio.run(run_tool(add, '{"a": 2, "b": 3}')) == ("5", True)
    text, ok = asyncio.run(run_tool(add, "{not json"))
    assert not ok and "bad arguments" in text
    text, ok = asyncio.run(run_tool(add, '[1, 2]'))
    assert not ok and "JSON object" in text
    text, ok = asyncio.run(run_tool(add, '{"a": 1}'))
    assert not ok and "TypeError" in text
    boom = _tool(lambda: 1 / 0)
    text, ok = asyncio.run(run_tool(boom, "{}"))
    assert not ok and "ZeroDivisionError" in text


def test_timeouts_sync_and_async():
    slow = _tool(lambda: time.sleep(2), timeout_s=0.1)
    text, ok = asyncio.run(run_tool(slow, "{}"))
    assert not ok and "timed out" in text

    async def aslow():
        await asyncio.sleep(2)

    text, ok = asyncio.run(run_tool(_tool(aslow, timeout_s=0.1), {}))
    assert not ok and "timed out" in text


def test_hung_sync_tools_do_not_block_the_default_executor():
    """Sync tools run on their own bounded pool: hung ones (more than the
    default executor has threads) time out as errors, and asyncio.to_thread
    work (what RLTrainer.update uses) still runs."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    release = threading.Event()
    hung = _tool(lambda: release.wait(30), timeout_s=0.05)

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=2))
        results = await asyncio.gather(*(run_tool(hung, {}) for _ in range(4)))
        done = threading.Event()
        # Would wait for a hung tool's thread if tools shared the default executor.
        await asyncio.wait_for(asyncio.to_thread(done.set), 10)
        return results, done.is_set()

    try:
        results, ran = asyncio.run(main())
    finally:
        release.set()
    assert ran
    assert all(not ok and "timed out" in text for text, ok in results)


def test_hashed_seed_is_the_sha256_of_the_joined_parts():
    import hashlib

    from ac2_jax.seeds import hashed_seed
    want = int.from_bytes(hashlib.sha256(b"refill:7:3:2").digest()[:8], "big") >> 1
    assert hashed_seed("refill", 7, 3, 2) == want  # the refill / domain / request seeds' rule
    seeds = {hashed_seed(tag, s, i) for tag in ("a", "b") for s in range(5) for i in range(5)}
    assert len(seeds) == 50 and all(0 <= s < 2**63 for s in seeds)


def test_a_tool_that_takes_the_task_gets_the_attempts_task():
    # Issue 68, finding 9: per-task tool state (a per-task database, a file tree) needed
    # module globals; a tool fn with a `task` parameter now gets the attempt's Task.
    from ac2_jax.envs import Task
    from ac2_jax.orchestration import DefaultOrchestrator
    from tests.support.recipe_helpers import ParityEnv

    tables = {"t1": {"a": "1"}, "t2": {"a": "2"}}

    def lookup(key, task):  # `task` is not in the schema: the model never sends it
        return tables[task.task_id][key]

    async def alookup(key, *, task):
        return tables[task.task_id][key] + "!"

    tool = Tool("lookup", "Looks a key up in this task's table.",
                {"type": "object", "properties": {"key": {"type": "string"}}}, lookup)
    assert tool.takes_task and not _tool(lambda a: a).takes_task
    # A schema that lists "task" makes it the model's argument (spawn_subagent's is).
    assert not Tool("s", "", {"type": "object", "properties": {"task": {}}}, lookup).takes_task
    t2 = Task(task_id="t2", prompt="?")
    assert asyncio.run(run_tool(tool, '{"key": "a"}', task=t2)) == ("2", True)
    atool = Tool("lookup", "", {"type": "object"}, alookup)
    assert asyncio.run(run_tool(atool, {"key": "a"}, task=t2)) == ("2!", True)
    # The model cannot pass it, and a tool that takes it needs one.
    text, ok = asyncio.run(run_tool(tool, '{"key": "a", "task": "t1"}', task=t2))
    assert not ok and "'task' is not an argument the model gives" in text
    text, ok = asyncio.run(run_tool(tool, '{"key": "a"}'))
    assert not ok and "takes the task, and none was given" in text

    class TableEnv(ParityEnv):
        @property
        def tools(self):
            return [tool]

    # The tool loop gives each attempt's task.
    for task_id, want in (("t1", "1"), ("t2", "2")):
        orch = DefaultOrchestrator(TableEnv(), Task(task_id=task_id, prompt="?"), None, "m")
        assert asyncio.run(orch.call_tool("lookup", '{"key": "a"}')) == (want, True)
