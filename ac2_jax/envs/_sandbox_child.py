"""The child side of a sandboxed tool call (see sandbox.py). Standard library only.

Run as `python -I _sandbox_child.py ROOT` with ROOT/scratch as cwd. Reads
ROOT/call.json (sys.path, limits) and ROOT/call.pickle ((fn, kwargs)), sets
the resource limits, calls fn, and writes ROOT/result.json:
{"ok": true, "text": ...} or {"ok": false, "kind": "memory" | "exception" | "setup",
"error": ...}. A crash, signal or nonzero exit writes nothing; the parent
reads those from the exit status.
"""

import asyncio
import inspect
import json
import math
import os
import pickle
import resource
import sys


def _cap(text: str, limit: int) -> str:
    data = text.encode("utf-8", "replace")
    if len(data) <= limit:
        return text
    kept = data[:limit].decode("utf-8", "ignore")
    return f"{kept}\n[result cut: {len(data) - limit} more bytes not shown]"


def _write(root: str, result: dict) -> None:
    tmp = os.path.join(root, "result.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(result, f)
    os.replace(tmp, os.path.join(root, "result.json"))


def main(root: str) -> None:
    with open(os.path.join(root, "call.json"), encoding="utf-8") as f:
        call = json.load(f)
    sys.path[:] = call["sys_path"]
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if call["cpu_s"] is not None:
        soft = max(1, math.ceil(call["cpu_s"]))
        resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))  # SIGXCPU, then SIGKILL
    try:
        with open(os.path.join(root, "call.pickle"), "rb") as f:
            fn, kwargs = pickle.load(f)
    except Exception as e:  # noqa: BLE001 - reported to the parent as a setup failure
        _write(root, {"ok": False, "kind": "setup", "error": f"{type(e).__name__}: {e}"})
        return
    if call["memory_mb"] is not None:
        limit = int(call["memory_mb"]) * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        result = asyncio.run(fn(**kwargs)) if inspect.iscoroutinefunction(fn) else fn(**kwargs)
        out = {"ok": True, "text": _cap(str(result), call["output_bytes"])}
    except MemoryError as e:
        out = {"ok": False, "kind": "memory", "error": f"MemoryError: {e}"}
    except Exception as e:  # noqa: BLE001 - the tool's own failure, text for the agent
        out = {
            "ok": False,
            "kind": "exception",
            "error": _cap(f"{type(e).__name__}: {e}", call["output_bytes"]),
        }
    sys.stdout.flush()
    sys.stderr.flush()
    _write(root, out)


if __name__ == "__main__":
    main(sys.argv[1])
