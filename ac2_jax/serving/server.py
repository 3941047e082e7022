"""Running the endpoint: in a background thread (tests, demos, notebooks) or
as a process (`python -m ac2_jax.serving`, flags in `__main__`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

import uvicorn


def serve_in_thread(app, host: str = "127.0.0.1", port: int = 0,
                    startup_timeout_s: float = 60.0) -> tuple[str, Callable[[], None]]:
    """Starts uvicorn for `app` in a daemon thread; returns (base_url, stop).

    port=0 picks a free port. base_url is like "http://127.0.0.1:PORT" (add
    "/v1" for OpenAI clients). stop() shuts the server down and joins the
    thread; calling it twice is harmless.
    """
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    errors: list[BaseException] = []

    def run():
        try:
            asyncio.run(server.serve())
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            errors.append(e)

    thread = threading.Thread(target=run, name=f"ac2-serving-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if errors or not thread.is_alive():
            raise RuntimeError(f"serve_in_thread: the server failed to start: {errors}")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"serve_in_thread: not started after {startup_timeout_s} s")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host

    def stop():
        server.should_exit = True
        thread.join(timeout=30)

    return f"http://{url_host}:{bound}", stop
