"""Load harness for the endpoint, run in its own process against a server URL.

N multi-turn rollouts (at most `concurrency` at a time) x T turns: each
rollout is created with the admin key (metadata {"harness_run", "index"}),
each turn is one chat completion through the real `openai` client with the
rollout's own key (max_retries=0: a retry would record a second completion),
whose messages are the previous turns plus a marker unique to
(run, rollout, turn); then the admin finishes it (reward 1.0). A rollout
whose create, turn or finish fails is reported `lost` with the error; the run
goes on. `audit` then reads a trace store and checks each stored trace holds
exactly its own conversation.

    python -m benchmarks.endpoint_harness --url http://127.0.0.1:8000 \
        --admin_key sk-... --rollouts 16 --turns 4 --out report.json

Also here: `ServerProcess`, the endpoint as a `python -m ac2_jax.serving`
child process (start, SIGKILL, RSS), and `BackendProcess`, a sampler backend
(`python -m ac2_jax.serving.backend`), for the tests and the benchmarks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

import httpx
import openai

MODEL = "tiny"
_MARKER_RE = re.compile(r"\[mk (\w+) (\d+) (\d+)\]")


def marker(run_id: str, index: int, turn: int) -> str:
    """The text that only turn `turn` of rollout `index` of run `run_id` sends."""
    return f"[mk {run_id} {index:05d} {turn:03d}]"


def find_markers(text: str) -> list[tuple[str, int, int]]:
    """(run_id, index, turn) of every marker in `text`, in order."""
    return [(m[1], int(m[2]), int(m[3])) for m in _MARKER_RE.finditer(text)]


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid` (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def run_rollout(admin: httpx.AsyncClient, run_id: str, index: int, turns: int,
                      max_tokens: int, timeout_s: float) -> dict[str, Any]:
    """One rollout: create, `turns` chat completions, finish. Never raises.

    status: "finished", "lost" (created, then a turn or the finish failed) or
    "not_created" (the create failed: the server never had it). A lost rollout
    is then finished as infra_error if the server still answers; `ended_as`
    says how that went."""
    out: dict[str, Any] = {"index": index, "rollout_id": None, "status": "lost", "error": None,
                           "turns_done": 0, "latency_s": [], "completion_tokens": []}
    step = "create"
    client = None
    try:
        r = await admin.post("/v1/rollouts", json={
            "task_id": f"harness-{run_id}", "group_id": run_id,
            "metadata": {"harness_run": run_id, "index": index}})
        r.raise_for_status()
        info = r.json()
        out["rollout_id"] = info["rollout_id"]
        client = openai.AsyncOpenAI(base_url=info["base_url"], api_key=info["api_key"],
                                    max_retries=0, timeout=timeout_s)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"You are load-test rollout {index}."}]
        for t in range(turns):
            step = f"turn {t}"
            messages.append({"role": "user", "content": f"Turn {t} {marker(run_id, index, t)}"})
            t0 = time.perf_counter()
            resp = await client.chat.completions.create(model=MODEL, messages=messages,
                                                        max_tokens=max_tokens, temperature=1.0)
            out["latency_s"].append(time.perf_counter() - t0)
            out["completion_tokens"].append(resp.usage.completion_tokens)
            messages.append({"role": "assistant", "content": resp.choices[0].message.content})
            out["turns_done"] = t + 1
        step = "finish"
        r = await admin.post(f"/v1/rollouts/{info['rollout_id']}/finish",
                             json={"status": "finished", "reward": 1.0})
        r.raise_for_status()
        out["status"] = "finished"
    except Exception as e:  # noqa: BLE001 - reported per rollout: lost, with the reason
        out["error"] = f"{step}: {type(e).__name__}: {e}"[:500]
        if out["rollout_id"] is None:
            out["status"] = "not_created"
        elif step != "finish":  # end it on the server too, so it is stored, never trained
            try:
                r = await admin.post(f"/v1/rollouts/{out['rollout_id']}/finish",
                                     json={"status": "infra_error",
                                           "artifacts": {"harness_error": out["error"]}})
                out["ended_as"] = ("infra_error" if r.status_code == 200
                                   else f"HTTP {r.status_code}")
            except Exception as e2:  # noqa: BLE001 - e.g. the server is gone
                out["ended_as"] = f"{type(e2).__name__}"
    finally:
        if client is not None:
            await client.close()
    return out


async def run_load(url: str, admin_key: str, *, rollouts: int, turns: int, concurrency: int,
                   max_tokens: int = 4, run_id: str | None = None, timeout_s: float = 300.0,
                   rss_pid: int | None = None, rss_every: int = 50,
                   on_done: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Runs the load; returns the report (see `main`). rss_pid: a process whose
    RSS is sampled every `rss_every` ended rollouts (the server's, on this host)."""
    if rollouts < 1 or turns < 1 or concurrency < 1:
        raise ValueError(f"rollouts, turns and concurrency must be >= 1, got "
                         f"{rollouts}, {turns}, {concurrency}")
    run_id = run_id or secrets.token_hex(4)
    if not re.fullmatch(r"\w+", run_id):
        raise ValueError(f"run_id must match \\w+, got {run_id!r}")
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    admin = httpx.AsyncClient(base_url=url.rstrip("/"), timeout=timeout_s, limits=limits,
                              headers={"Authorization": f"Bearer {admin_key}"})
    sem = asyncio.Semaphore(concurrency)
    results: list[dict[str, Any]] = []
    rss: list[dict[str, float]] = []

    async def sample_rss():
        row: dict[str, Any] = {"rollouts_ended": len(results)}
        try:
            row["rss_bytes"] = rss_bytes(rss_pid)
        except (OSError, RuntimeError) as e:  # the process is gone (e.g. killed): say so
            row.update(rss_bytes=None, error=str(e))
        try:  # the sampler's compile set (JaxSampler servers show it to the admin)
            r = await admin.get("/v1/models")
            row["compiled_shapes"] = r.json()["data"][0].get("sampler_stats", {}).get(
                "compiled_shapes")
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            row["compiled_shapes"] = None
        rss.append(row)

    async def one(i):
        async with sem:
            res = await run_rollout(admin, run_id, i, turns, max_tokens, timeout_s)
        results.append(res)
        if on_done is not None:
            on_done(res)
        if rss_pid is not None and len(results) % rss_every == 0:
            await sample_rss()

    if rss_pid is not None:
        await sample_rss()
    t0, t_start = time.perf_counter(), time.time()
    try:
        await asyncio.gather(*(one(i) for i in range(rollouts)))
    finally:
        await admin.aclose()
    wall = time.perf_counter() - t0
    results.sort(key=lambda r: r["index"])
    done = sum(r["turns_done"] for r in results)
    lat = sorted(x for r in results for x in r["latency_s"])
    return {"run_id": run_id, "url": url, "rollouts": rollouts, "turns": turns,
            "concurrency": concurrency, "max_tokens": max_tokens, "wall_s": wall,
            "t_start": t_start, "t_end": t_start + wall,
            "requests": done, "req_per_s": done / wall,
            "latency_p50_s": _pct(lat, 50), "latency_p99_s": _pct(lat, 99),
            "finished": sum(r["status"] == "finished" for r in results),
            "lost": [r["index"] for r in results if r["status"] == "lost"],
            "not_created": [r["index"] for r in results if r["status"] == "not_created"],
            "rss": rss, "results": results}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return sorted(xs)[k]


def audit(traces: Iterable, run_id: str, rollouts: int, turns: int,
          decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """Checks the stored traces of run `run_id` against the conversations sent.

    A finished trace is `ok` when its completions are exactly `turns`, completion k's
    prompt (decoded) holds the markers of turns 0..k of its own rollout in
    order, and no completion (prompt or output) holds any other marker.
    Other statuses are listed in `not_finished` and their content checks skip
    the turn count (they ended early). Returns {"stored": indices, "missing":
    indices never stored, "duplicates", "not_finished": {index: status},
    "cross_wired": [(index, reason)], "sample_s": {(index, turn): seconds}}.
    """
    stored: list[int] = []
    cross: list[tuple[int, str]] = []
    not_finished: dict[int, str] = {}
    sample_s: dict[tuple[int, int], float] = {}
    for tr in traces:
        if tr.metadata.get("harness_run") != run_id:
            continue
        i = int(tr.metadata["index"])
        stored.append(i)
        if tr.status != "finished":
            not_finished[i] = tr.status
        comps = [c for ep in tr.episodes for c in ep.completions]
        seen = set()
        for c in comps:
            got = find_markers(decode(list(c.prompt_ids)))
            k = len(got) - 1
            want = [(run_id, i, t) for t in range(k + 1)]
            if got != want:
                cross.append((i, f"prompt markers {got} != {want}"))
                continue
            if find_markers(decode(list(c.output_ids))):
                cross.append((i, f"output of turn {k} holds a marker"))
            if k in seen:
                cross.append((i, f"turn {k} recorded twice"))
            seen.add(k)
            if "sample_s" in c.timings:
                sample_s[(i, k)] = float(c.timings["sample_s"])
        if seen != set(range(len(seen) if i in not_finished else turns)):
            cross.append((i, f"turns recorded {sorted(seen)} != 0..{turns - 1}"))
    dup = sorted({i for i in stored if stored.count(i) > 1})
    return {"stored": sorted(set(stored)), "missing": sorted(set(range(rollouts)) - set(stored)),
            "duplicates": dup, "not_finished": not_finished, "cross_wired": cross,
            "sample_s": sample_s}


def lost_rollouts(report: dict[str, Any], stored: Iterable[int]) -> list[dict[str, Any]]:
    """Rollouts the server created for `report` whose trace is not in the store
    (`stored`: indices, from `audit`): what a crash lost. Each with its error."""
    have = set(stored)
    return [{k: r[k] for k in ("index", "rollout_id", "turns_done", "error")}
            for r in report["results"] if r["rollout_id"] is not None and r["index"] not in have]


def overhead_s(report: dict[str, Any], sample_s: dict[tuple[int, int], float]) -> list[float]:
    """Per completion: client latency minus the sampler time the server recorded."""
    return [lat - sample_s[(r["index"], k)] for r in report["results"]
            for k, lat in enumerate(r["latency_s"]) if (r["index"], k) in sample_s]


class ServerProcess:
    """`python -m ac2_jax.serving --model=tiny` as a child process on a free port.

    flags: extra `--flag=value` strings. repo: the checkout whose `ac2_jax` runs
    (default: this one). env: overrides of the child's environment. `url` is
    set once it answers.
    """

    def __init__(self, trace_store: str, admin_key: str, log_path: str,
                 flags: Iterable[str] = (), python: str = sys.executable,
                 repo: str | None = None, env: dict[str, str] | None = None):
        self.cmd = [python, "-m", "ac2_jax.serving", "--model=tiny", "--port=0",
                    f"--admin_key={admin_key}", f"--trace_store={trace_store}", *flags]
        self.admin_key, self.log_path = admin_key, log_path
        self.repo = repo or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None

    def start(self, timeout_s: float = 120.0) -> str:
        self.launch()
        return self.wait_ready(timeout_s)

    def launch(self) -> None:
        """Starts the process without waiting (`wait_ready` waits)."""
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), **self.env}
        repo = self.repo
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     cwd=repo)
        log.close()

    def wait_ready(self, timeout_s: float = 120.0) -> str:
        """Waits until the process answers GET /v1/models; returns its URL."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; log: "
                                   f"{self.log_tail()}")
            with open(self.log_path, errors="replace") as f:
                found = re.findall(r"Uvicorn running on (http://\S+)", f.read())
            if found:
                self.url = found[-1]
                r = httpx.get(self.url + "/v1/models", timeout=10,
                              headers={"Authorization": f"Bearer {self.admin_key}"}
                              if self.admin_key else {})
                r.raise_for_status()
                return self.url
            time.sleep(0.1)
        self.kill()
        raise TimeoutError(f"server not up after {timeout_s} s; log: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=60)


class BackendProcess(ServerProcess):
    """`python -m ac2_jax.serving.backend --model=MODEL` (one JaxSampler behind
    SGLang's HTTP API) as a child process on a free port. model: "tiny" or an
    HF directory. flags: extra `--flag=value` strings (e.g. `--seed=1`)."""

    def __init__(self, log_path: str, flags: Iterable[str] = (), python: str = sys.executable,
                 repo: str | None = None, env: dict[str, str] | None = None,
                 model: str = "tiny"):
        super().__init__("", "", log_path, python=python, repo=repo, env=env)
        self.cmd = [python, "-m", "ac2_jax.serving.backend", f"--model={model}", "--port=0",
                    *flags]


def main(argv=None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    p.add_argument("--admin_key", required=True)
    p.add_argument("--rollouts", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=None, help="default: all rollouts")
    p.add_argument("--max_tokens", type=int, default=4)
    p.add_argument("--run_id", default=None)
    p.add_argument("--timeout_s", type=float, default=300.0)
    p.add_argument("--rss_pid", type=int, default=None)
    p.add_argument("--rss_every", type=int, default=50)
    p.add_argument("--progress", default=None,
                   help="append one JSON line per ended rollout here (flushed)")
    p.add_argument("--out", default=None, help="write the report as JSON here")
    p.add_argument("--start_at", type=float, default=None,
                   help="wall-clock time (time.time()) to start at: client processes together")
    a = p.parse_args(argv)
    if a.start_at is not None:
        time.sleep(max(0.0, a.start_at - time.time()))
    progress = open(a.progress, "a") if a.progress else None

    def on_done(res):
        if progress is not None:
            progress.write(json.dumps({k: res[k] for k in ("index", "rollout_id", "status")})
                           + "\n")
            progress.flush()

    try:
        report = asyncio.run(run_load(
            a.url, a.admin_key, rollouts=a.rollouts, turns=a.turns,
            concurrency=a.concurrency or a.rollouts, max_tokens=a.max_tokens, run_id=a.run_id,
            timeout_s=a.timeout_s, rss_pid=a.rss_pid, rss_every=a.rss_every, on_done=on_done))
    finally:
        if progress is not None:
            progress.close()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f)
    print(json.dumps({k: v for k, v in report.items() if k not in ("results", "rss")}))
    return report


if __name__ == "__main__":
    main()
