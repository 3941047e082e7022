"""Run a coroutine from sync code, also when an event loop is running here."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def run_sync(make: Callable[[], Awaitable[T]]) -> T:
    """Runs the coroutine `make()` to completion and returns its result.

    Inside a running event loop (a sync `verify` called by an async rollout)
    it runs on a fresh loop in a helper thread, blocking the caller until done.
    """

    async def main() -> T:
        return await make()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    with ThreadPoolExecutor(1, thread_name_prefix="examples-sync") as pool:
        return pool.submit(asyncio.run, main()).result()
