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
