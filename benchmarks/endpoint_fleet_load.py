"""The endpoint over a sampler fleet under load from client *processes*, while a
learner-like process publishes weights (issue 42).

Processes: `--backends` sampler backends (`python -m ac2_jax.serving.backend
--model=tiny`), the endpoint over them (`python -m ac2_jax.serving --model=tiny
--backends=...`, a FleetSampler, with a trace store and a publish dir), a
publisher (this module with `--publisher`: every `--publish_every_s` it
publishes new weights of the served architecture with Orbax and POSTs
/v1/admin/load_weights, as the split learner does), and `--clients` client
processes (`benchmarks.endpoint_harness`, one rollout of `--turns` chat turns
each, started together at one wall-clock instant). Then the store is audited
(lost, never stored, cross-wired between rollouts) and the figures are
p50 / p99 client latency and requests/s over the load's wall time.

    python -m benchmarks.bench_endpoint --mode=fleet --clients=64 --turns=8 \
        --out bench_results/endpoint_fleet.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx

ADMIN = "sk-bench-fleet"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def publisher(url: str, publish_dir: str, every_s: float, stop_file: str, out: str) -> None:
    """The learner-like process: publishes step 1, 2, ... and has the endpoint load each."""
    from flax import nnx

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.models.io.params_io import publish_weights
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(os.path.join(os.path.dirname(out), "pub_tok"))
    loads: list[dict[str, Any]] = []
    step = 0
    with httpx.Client(base_url=url, timeout=600,
                      headers={"Authorization": f"Bearer {ADMIN}"}) as http:
        while not os.path.exists(stop_file):
            step += 1
            model = Decoder(DecoderConfig.tiny(vocab_size=tok.vocab_size), rngs=nnx.Rngs(step))
            publish_weights(model, publish_dir, step)
            t0 = time.perf_counter()
            r = http.post("/v1/admin/load_weights", json={"step": step, "learner_step": step})
            loads.append({"step": step, "status": r.status_code, "load_s": time.perf_counter() - t0,
                          "reply": r.json() if r.status_code == 200 else r.text[:300]})
            with open(out, "w") as f:
                json.dump(loads, f)
            end = time.monotonic() + every_s
            while time.monotonic() < end and not os.path.exists(stop_file):
                time.sleep(0.1)


def run(tmp: str, *, clients: int, turns: int, backends: int = 2, max_tokens: int = 16,
        max_context: int = 512, publish_every_s: float = 5.0, warmup: bool = True
        ) -> dict[str, Any]:
    """Runs the whole load once (module docstring); returns the figures and the audit."""
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
    from ac2_jax.trace import TraceStore
    from benchmarks.endpoint_harness import BackendProcess, ServerProcess, audit

    store, publish_dir = os.path.join(tmp, "traces.jsonl"), os.path.join(tmp, "published")
    from benchmarks.common import child_xla_flags

    env = {"XLA_FLAGS": child_xla_flags()}  # one CPU device each, the caller's compile flags
    per = max(8, -(-clients // backends))
    bps = [BackendProcess(os.path.join(tmp, f"backend{i}.log"), env=env,
                          flags=[f"--max_batch={per}", f"--max_context={max_context}"])
           for i in range(backends)]
    procs: list[Any] = list(bps)
    pub = None
    try:
        for b in bps:
            b.launch()
        urls = [b.wait_ready(300) for b in bps]
        server = ServerProcess(store, ADMIN, os.path.join(tmp, "server.log"), env=env, flags=[
            f"--backends={','.join(urls)}", f"--publish_dir={publish_dir}",
            f"--export_dir={os.path.join(tmp, 'export')}", f"--max_tokens={max_tokens}",
            f"--max_context={max_context}", "--backend_timeout_s=120"])
        procs.append(server)
        url = server.start(300)
        tok = build_tiny_tokenizer(os.path.join(tmp, "tok"))  # the server's: same corpus
        if warmup:  # unmeasured: every backend compiles its shapes for this traffic
            _clients(url, tmp, "warm", clients, turns, max_tokens, _start_at(clients))
        stop = os.path.join(tmp, "stop_publisher")
        loads_out = os.path.join(tmp, "loads.json")
        penv = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": child_xla_flags(),
                "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
        pub = subprocess.Popen([sys.executable, "-m", "benchmarks.endpoint_fleet_load",
                                "--publisher", "--url", url, "--publish_dir", publish_dir,
                                "--every_s", str(publish_every_s), "--stop_file", stop,
                                "--loads_out", loads_out], cwd=REPO, env=penv,
                               stdout=open(os.path.join(tmp, "publisher.log"), "wb"),
                               stderr=subprocess.STDOUT)
        while not os.path.exists(loads_out):  # the first publish is loaded
            if pub.poll() is not None:
                with open(os.path.join(tmp, "publisher.log")) as f:
                    raise RuntimeError(f"publisher exited: {f.read()[-2000:]}")
            time.sleep(0.2)
        reports = _clients(url, tmp, "load", clients, turns, max_tokens, _start_at(clients))
        open(stop, "w").close()
        pub.wait(timeout=600)
        status = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {ADMIN}"},
                           timeout=30).json()["data"][0]
    finally:
        if pub is not None and pub.poll() is None:
            pub.kill()
        for p in procs:
            p.kill(signal.SIGTERM)
    loads = json.load(open(loads_out))
    traces = TraceStore(store).load(on_error="raise")
    lat = [x for r in reports for res in r["results"] for x in res["latency_s"]]
    t0, t1 = min(r["t_start"] for r in reports), max(r["t_end"] for r in reports)
    lost = missing = dup = 0
    cross: list = []
    for r in reports:
        a = audit(traces, r["run_id"], r["rollouts"], r["turns"], tok.decode)
        lost += len(r["lost"]) + len(r["not_created"])
        missing += len(a["missing"])
        dup += len(a["duplicates"])
        cross += a["cross_wired"]
    ran = {r["run_id"] for r in reports}
    versions = sorted({c.policy_version for t in traces if t.metadata.get("harness_run") in ran
                       for e in t.episodes for c in e.completions})
    return {"clients": clients, "client_processes": len(reports), "turns": turns,
            "backends": backends, "max_tokens": max_tokens,
            "requests": len(lat), "wall_s": t1 - t0, "req_per_s": len(lat) / (t1 - t0),
            "start_spread_s": max(r["t_start"] for r in reports) - t0,
            "latency_p50_ms": 1e3 * _pct(lat, 50), "latency_p99_ms": 1e3 * _pct(lat, 99),
            "lost": lost, "missing": missing, "duplicates": dup, "cross_wired": len(cross),
            "cross_wired_examples": cross[:3],
            "weight_loads": len(loads), "weight_loads_ok": sum(x["status"] == 200 for x in loads),
            "load_s_p50": _pct([x["load_s"] for x in loads], 50),
            "versions_sampled": versions, "fleet": status.get("sampler_stats")}


def _start_at(clients: int) -> float:
    """When the client processes start: after each has imported its modules (~1 CPU
    second each, on 2 cores), so the load begins at once rather than in a trickle."""
    return time.time() + 3 + 0.75 * clients


def _clients(url: str, tmp: str, tag: str, n: int, turns: int, max_tokens: int,
             start_at: float) -> list[dict[str, Any]]:
    """n `benchmarks.endpoint_harness` processes, one rollout each, all starting at start_at."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get(
        "PYTHONPATH")]))}
    procs = []
    for i in range(n):
        out = os.path.join(tmp, f"{tag}{i}.json")
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "benchmarks.endpoint_harness", "--url", url, "--admin_key",
             ADMIN, "--rollouts", "1", "--turns", str(turns), "--max_tokens", str(max_tokens),
             "--run_id", f"{tag}{i}", "--out", out, "--start_at", str(start_at)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), out))
    reports = []
    for p, out in procs:
        text = p.communicate(timeout=1800)[0]
        if p.returncode != 0:
            raise RuntimeError(f"client {out} failed: {text[-2000:]!r}")
        reports.append(json.load(open(out)))
    return reports


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--publisher", action="store_true", help="run as the publisher process")
    p.add_argument("--url")
    p.add_argument("--publish_dir")
    p.add_argument("--every_s", type=float, default=5.0)
    p.add_argument("--stop_file")
    p.add_argument("--loads_out")
    a = p.parse_args(argv)
    if a.publisher:
        publisher(a.url, a.publish_dir, a.every_s, a.stop_file, a.loads_out)


if __name__ == "__main__":
    main()
