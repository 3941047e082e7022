"""The library's one sync runner: every long operation is async (`arl`, `adistill`,
`aeval_model`, `asample`, ...); its plain-named form runs it from sync code through
`run_sync`, which refuses clearly inside a running event loop (a notebook, a server)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_sync(coro: Coroutine[Any, Any, T], who: str) -> T:
    """Runs `coro` to completion from sync code and returns its result. Inside a running
    event loop it closes `coro` and raises one line naming the async form to await:
    `who` is the sync name, "a" + `who` the async one."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError(f"{who} was called inside a running event loop; await a{who}(...)")
