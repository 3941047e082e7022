"""Endpoint overhead: openai client -> FastAPI (127.0.0.1) -> JaxSampler vs a direct
`await sampler.generate(...)`, same tiny model, prompt and greedy params, one run.

Latency: one request at a time, HTTP and direct calls interleaved (so machine
load hits both alike); p50 / p99 of each and of the paired difference
(HTTP minus the direct call next to it). HTTP rows: Chat Completions with the
admin key (nothing recorded) and with a rollout key (each completion recorded
into the rollout's trace, as in RL), and the same rollout-key request through
the Anthropic Messages route (`anthropic` SDK, `http_messages`) and the OpenAI
Responses route (`client.responses`, `http_responses`): same prompt, same
greedy tokens, so their difference to `http_rollout` is the cost of the API's
translation and response shape. Throughput: C concurrent clients (asyncio tasks; HTTP: one
AsyncOpenAI client and one rollout per task), each sending requests back to
back; requests/s and output tokens/s. The server runs in a thread of this
process (`serve_in_thread`), so client, server and sampler share the CPUs.

    python -m benchmarks.bench_endpoint --out bench_results/endpoint.json

--mode=process: the endpoint in its own process (`python -m ac2_jax.serving
--model=tiny`, random weights) and the load from `benchmarks.endpoint_harness`
in another: per client count C, C concurrent multi-turn rollouts (the
conversation grows each turn); requests/s, client latency, and overhead =
client latency minus the sampler time the server recorded for that
completion (`timings.sample_s` in the stored trace). Then a memory run:
`--memory_rollouts` rollouts at the largest C, the server's RSS sampled every
`--rss_every` ended rollouts, with the sampler's compiled-shape count (the
admin's `sampler_stats` in GET /v1/models). The server's JaxSampler runs with
`--fixed_shapes` (compiled at start) unless `--no-fixed_shapes`: bucketed
shapes keep compiling under varied traffic, and each executable stays in
memory. Every run is audited: lost, never stored, cross-wired.

    python -m benchmarks.bench_endpoint --mode=process --clients=1,8,64 --turns=8 \
        --memory_rollouts=1000 --out bench_results/endpoint_process.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import httpx  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import openai  # noqa: E402
from flax import nnx  # noqa: E402

from ac2_jax.models import Decoder, DecoderConfig  # noqa: E402
from ac2_jax.sampling import SamplingParams  # noqa: E402
from ac2_jax.sampling.engine.jax_sampler import JaxSampler  # noqa: E402
from ac2_jax.serving.app import build_app  # noqa: E402
from ac2_jax.serving.core.splice import build_prompt_ids  # noqa: E402
from ac2_jax.serving.server import serve_in_thread  # noqa: E402
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer  # noqa: E402
from ac2_jax.trace import TraceStore  # noqa: E402
from benchmarks.common import child_xla_flags, parser, print_table, write_json  # noqa: E402
from benchmarks.endpoint_harness import ServerProcess, audit, overhead_s, rss_bytes  # noqa: E402

ADMIN = "sk-bench-admin"
MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "You are a calculator agent."},
            {"role": "user", "content": "What is 3 + 4 + 10?"}]


_COMPILES = [0]
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _d, **_kw: _COMPILES.__setitem__(0, _COMPILES[0] + (
        event == "/jax/core/compile/backend_compile_duration")))


def pct(xs, q: float) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q))


def build(max_tokens: int, max_batch: int, tmp: str):
    """Tokenizer, sampler and the prompt ids / params the endpoint will also use.

    Tries model seeds until greedy decoding runs the full max_tokens without a
    stop token, so every request outputs exactly max_tokens tokens."""
    tok = build_tiny_tokenizer(os.path.join(tmp, "tok"))
    prompt_ids, _ = build_prompt_ids(tok, MESSAGES)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            stop_token_ids=tok.stop_token_ids)
    for seed in range(20):
        cfg = DecoderConfig.tiny(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                                 num_heads=4, num_kv_heads=2, head_dim=16,
                                 max_position_embeddings=256)
        small = min(8, max_batch)  # row buckets 8..max_batch: fewer shapes to compile
        sampler = JaxSampler(Decoder(cfg, rngs=nnx.Rngs(seed)), max_context=256,
                             max_batch=max_batch, min_batch=small, min_prefill_rows=small,
                             min_cache_len=256, max_top_logprobs=0,
                             eos_token_ids=tok.stop_token_ids, tokenizer=tok)
        out = asyncio.run(sampler.generate(prompt_ids, params))
        if len(out.output_ids) == max_tokens:
            return tok, sampler, prompt_ids, params, seed
        sampler.close()
    raise RuntimeError("no model seed in 0..19 decodes max_tokens tokens without a stop token")


class Bench:
    def __init__(self, url: str, sampler: JaxSampler, prompt_ids, params, max_tokens: int):
        self.url, self.sampler = url, sampler
        self.prompt_ids, self.params, self.max_tokens = prompt_ids, params, max_tokens
        self.admin_http = httpx.AsyncClient(base_url=url, timeout=600,
                                            headers={"Authorization": f"Bearer {ADMIN}"})

    async def rollout_client(self, task_id: str) -> openai.AsyncOpenAI:
        r = await self.admin_http.post("/v1/rollouts", json={"task_id": task_id})
        r.raise_for_status()
        info = r.json()
        return openai.AsyncOpenAI(base_url=info["base_url"], api_key=info["api_key"],
                                  max_retries=0, timeout=600)

    def admin_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=ADMIN, max_retries=0,
                                  timeout=600)

    async def direct(self) -> int:
        r = await self.sampler.generate(self.prompt_ids, self.params)
        return len(r.output_ids)

    async def http(self, client: openai.AsyncOpenAI) -> int:
        resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                                    temperature=0, max_tokens=self.max_tokens)
        return resp.usage.completion_tokens

    async def messages(self, client) -> int:
        """The same request through POST /v1/messages (the `anthropic` SDK)."""
        system = [m["content"] for m in MESSAGES if m["role"] == "system"]
        resp = await client.messages.create(  # the SDK (2.x) takes temperature in extra_body
            model=MODEL, max_tokens=self.max_tokens, extra_body={"temperature": 0},
            messages=[m for m in MESSAGES if m["role"] != "system"],
            **({"system": system[0]} if system else {}))
        return resp.usage.output_tokens

    async def responses(self, client: openai.AsyncOpenAI) -> int:
        """The same request through POST /v1/responses."""
        resp = await client.responses.create(model=MODEL, input=MESSAGES, temperature=0,
                                             max_output_tokens=self.max_tokens)
        return resp.usage.output_tokens

    async def latency(self, n: int) -> dict[str, list[float]]:
        """n rounds of (direct, http admin, http rollout, messages, responses), in
        rotating order. Each API gets its own rollout (each is one conversation
        repeated, so one episode that grows no prompt)."""
        import anthropic

        admin, rollout = self.admin_client(), await self.rollout_client("latency")
        resp_client = await self.rollout_client("latency-responses")
        r = await self.admin_http.post("/v1/rollouts", json={"task_id": "latency-messages"})
        r.raise_for_status()
        msg_client = anthropic.AsyncAnthropic(base_url=self.url, api_key=r.json()["api_key"],
                                              max_retries=0, timeout=600)
        calls = {"direct": self.direct, "http_admin": lambda: self.http(admin),
                 "http_rollout": lambda: self.http(rollout),
                 "http_messages": lambda: self.messages(msg_client),
                 "http_responses": lambda: self.responses(resp_client)}
        times: dict[str, list[float]] = {k: [] for k in calls}
        names = list(calls)
        for i in range(n):
            k = i % len(names)
            for name in names[k:] + names[:k]:
                t0 = time.perf_counter()
                got = await calls[name]()
                times[name].append(time.perf_counter() - t0)
                if got != self.max_tokens:
                    raise RuntimeError(f"{name} returned {got} tokens, expected {self.max_tokens}")
        for c in (admin, rollout, resp_client, msg_client):
            await c.close()
        return times

    async def throughput(self, kind: str, clients: int, per_client: int) -> dict:
        if kind == "direct":
            fns = [self.direct] * clients
            closers = []
        else:
            cs = await asyncio.gather(*(self.rollout_client(f"tp-{clients}-{i}")
                                        for i in range(clients)))
            fns = [(lambda c=c: self.http(c)) for c in cs]
            closers = cs

        async def worker(fn):
            return sum([await fn() for _ in range(per_client)])

        c0, t0 = _COMPILES[0], time.perf_counter()
        tokens = sum(await asyncio.gather(*(worker(f) for f in fns)))
        wall = time.perf_counter() - t0
        for c in closers:
            await c.close()
        n = clients * per_client
        return {"impl": kind, "clients": clients, "requests": n, "wall_s": wall,
                "req_per_s": n / wall, "out_tok_per_s": tokens / wall,
                "compiles": _COMPILES[0] - c0}


def summarize(times: dict[str, list[float]]) -> list[dict]:
    rows = []
    d = times["direct"]
    for name, xs in times.items():
        row = {"impl": name, "n": len(xs), "p50_ms": 1e3 * pct(xs, 50), "p99_ms": 1e3 * pct(xs, 99),
               "mean_ms": 1e3 * statistics.mean(xs)}
        if name != "direct":
            diff = [a - b for a, b in zip(xs, d)]
            row.update(diff_p50_ms=1e3 * pct(diff, 50), diff_p99_ms=1e3 * pct(diff, 99))
        rows.append(row)
    return rows


async def warm(fn, rounds: int = 8) -> None:
    for _ in range(rounds):
        c0 = _COMPILES[0]
        await fn()
        if _COMPILES[0] == c0:
            return


async def run(args, url, sampler, prompt_ids, params) -> tuple[list[dict], list[dict]]:
    b = Bench(url, sampler, prompt_ids, params, args.max_tokens)
    clients = [int(c) for c in args.clients.split(",")]
    # Warm-up: repeat each setting until a round compiles nothing new (arrival
    # order decides the row / prefill shapes, so one round does not cover them).
    await warm(lambda: b.latency(3))
    for c in clients:
        for kind in ("direct", "http"):
            await warm(lambda: b.throughput(kind, c, max(1, args.throughput_requests // c // 2)))
    c0 = _COMPILES[0]
    lat = summarize(await b.latency(args.latency_requests))
    print(f"compiles during the latency rounds: {_COMPILES[0] - c0}")
    tp = []
    for c in clients:
        per = max(1, args.throughput_requests // c)
        for kind in ("direct", "http"):
            tp.append(await b.throughput(kind, c, per))
            print(tp[-1], flush=True)
    await b.admin_http.aclose()
    return lat, tp


def run_harness(url: str, run_id: str, out_dir: str, **kw) -> dict:
    """`benchmarks.endpoint_harness` in its own process; its JSON report."""
    out = os.path.join(out_dir, f"harness_{run_id}.json")
    args = [sys.executable, "-m", "benchmarks.endpoint_harness", "--url", url,
            "--admin_key", ADMIN, "--run_id", run_id, "--out", out]
    for k, v in kw.items():
        if v is not None:
            args += [f"--{k}", str(v)]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(args, cwd=repo, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"harness {run_id} failed ({proc.returncode}): {proc.stdout[-2000:]}"
                           f"{proc.stderr[-2000:]}")
    with open(out) as f:
        return json.load(f)


def process_mode(args, tmp: str) -> dict:
    """Server and harness in their own processes (see the module docstring)."""
    clients = [int(c) for c in args.clients.split(",")]
    top = max(clients)
    store = os.path.join(tmp, "traces.jsonl")
    server = ServerProcess(store, ADMIN, os.path.join(tmp, "server.log"),
                           env={"XLA_FLAGS": child_xla_flags()},  # one CPU device
                           flags=[f"--max_tokens={args.max_tokens}", f"--max_batch={top}",
                                  f"--max_context={args.max_context}",
                                  f"--fixed_shapes={str(args.fixed_shapes).lower()}"])
    tok = build_tiny_tokenizer(os.path.join(tmp, "tok"))  # the server's: same corpus, same BPE
    url = server.start()
    runs: list[tuple[dict, dict]] = []  # (row, harness report)
    common = dict(turns=args.turns, max_tokens=args.max_tokens)
    try:
        for w in range(args.warmup_runs):  # compiles: row, prefill and cache buckets
            for c in clients:
                run_harness(url, f"warm{w}c{c}", tmp, rollouts=c, concurrency=c, **common)
        for c in clients:
            rep = run_harness(url, f"c{c}", tmp, rollouts=c * args.rollouts_per_client,
                              concurrency=c, **common)
            runs.append(({"run": f"c{c}", "clients": c}, rep))
        if args.memory_rollouts:
            rep = run_harness(url, "mem", tmp, rollouts=args.memory_rollouts, concurrency=top,
                              turns=args.memory_turns, max_tokens=args.max_tokens,
                              rss_pid=server.pid, rss_every=args.rss_every)
            runs.append(({"run": "mem", "clients": top}, rep))
        rss_end = rss_bytes(server.pid)
    finally:
        server.kill(signal.SIGTERM)
    traces = TraceStore(store).load(on_error="raise")
    rows = []
    for row, rep in runs:
        a = audit(traces, rep["run_id"], rep["rollouts"], rep["turns"], tok.decode)
        over = overhead_s(rep, a["sample_s"])
        row.update(rollouts=rep["rollouts"], turns=rep["turns"], requests=rep["requests"],
                   wall_s=rep["wall_s"], req_per_s=rep["req_per_s"],
                   latency_p50_ms=1e3 * rep["latency_p50_s"],
                   overhead_p50_ms=1e3 * pct(over, 50) if over else None,
                   overhead_p99_ms=1e3 * pct(over, 99) if over else None,
                   overhead_n=len(over), lost=len(rep["lost"]) + len(rep["not_created"]),
                   missing=len(a["missing"]), cross_wired=len(a["cross_wired"]),
                   duplicates=len(a["duplicates"]), not_finished=len(a["not_finished"]))
        rows.append(row)
    mem = next((rep["rss"] for row, rep in runs if row["run"] == "mem"), [])
    return {"rows": rows, "rss": mem, "rss_end_bytes": rss_end, "traces_stored": len(traces),
            "audit_examples": {row["run"]: audit(traces, rep["run_id"], rep["rollouts"],
                                                 rep["turns"], tok.decode)["cross_wired"][:3]
                               for row, rep in runs}}


def main_process(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench_endpoint_proc_") as tmp:
        res = process_mode(args, tmp)
    load = os.getloadavg()
    print(f"\nserver process: tiny random model, max_tokens {args.max_tokens}, max_context "
          f"{args.max_context}; harness process; cpus {os.cpu_count()}, load average "
          f"{load[0]:.1f}")
    print_table(res["rows"], ["run", "clients", "rollouts", "turns", "requests", "wall_s",
                              "req_per_s", "latency_p50_ms", "overhead_p50_ms",
                              "overhead_p99_ms", "lost", "missing", "cross_wired"])
    if res["rss"]:
        mb = [(s["rollouts_ended"], (s["rss_bytes"] or 0) / 2**20, s.get("compiled_shapes"))
              for s in res["rss"]]
        print("\nserver RSS (MiB) [sampler compiled shapes] by rollouts ended: "
              + ", ".join(f"{n}: {m:.0f} [{c}]" for n, m, c in mb))
    write_json(args.out, {"benchmark": "endpoint_process", "config": vars(args),
                          "load_average": load, **res})
    return res


def main_fleet(args) -> dict:
    """--mode=fleet: `clients` (one count) client processes x `turns` against the endpoint
    over a fleet while weights are published (benchmarks/endpoint_fleet_load.py)."""
    from benchmarks.common import machine
    from benchmarks.endpoint_fleet_load import run as fleet_run

    clients = max(int(c) for c in args.clients.split(","))
    with tempfile.TemporaryDirectory(prefix="bench_endpoint_fleet_") as tmp:
        res = fleet_run(tmp, clients=clients, turns=args.turns, backends=args.backends,
                        max_tokens=args.max_tokens, max_context=args.max_context,
                        publish_every_s=args.publish_every_s)
    res["load_average"] = os.getloadavg()
    print_table([res], ["clients", "client_processes", "turns", "backends", "requests", "wall_s",
                        "req_per_s", "latency_p50_ms", "latency_p99_ms", "start_spread_s",
                        "lost", "missing", "cross_wired", "weight_loads_ok"])
    write_json(args.out, {"benchmark": "endpoint_fleet", "config": vars(args),
                          "machine": machine(), **res})
    return res


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["thread", "process", "fleet"], default="thread",
                   help="thread: server in this process vs direct sampler; process: see above; "
                   "fleet: benchmarks/endpoint_fleet_load.py (client processes, a fleet, "
                   "weights published meanwhile)")
    p.add_argument("--backends", type=int, default=2, help="(fleet) sampler backends")
    p.add_argument("--publish_every_s", type=float, default=5.0, help="(fleet)")
    p.add_argument("--turns", type=int, default=8, help="(process) turns per rollout")
    p.add_argument("--rollouts_per_client", type=int, default=2, help="(process)")
    p.add_argument("--max_context", type=int, default=512, help="(process) server context")
    p.add_argument("--warmup_runs", type=int, default=2,
                   help="(process) unmeasured runs of each client count first")
    p.add_argument("--memory_rollouts", type=int, default=0,
                   help="(process) rollouts of the memory run (0: none)")
    p.add_argument("--memory_turns", type=int, default=2, help="(process)")
    p.add_argument("--rss_every", type=int, default=50, help="(process)")
    p.add_argument("--fixed_shapes", action=argparse.BooleanOptionalAction, default=True,
                   help="(process) server JaxSampler with fixed shapes, compiled at start")
    p.add_argument("--max_tokens", type=int, default=16)
    p.add_argument("--latency_requests", type=int, default=150,
                   help="sequential rounds (each: one direct, one admin HTTP, one rollout HTTP)")
    p.add_argument("--clients", default="1,8,32,64")
    p.add_argument("--throughput_requests", type=int, default=256,
                   help="requests per throughput row (split over the clients)")
    args = p.parse_args(argv)
    if args.mode == "process":
        return main_process(args)
    if args.mode == "fleet":
        return main_fleet(args)
    max_batch = max(int(c) for c in args.clients.split(","))
    with tempfile.TemporaryDirectory(prefix="bench_endpoint_") as tmp:
        tok, sampler, prompt_ids, params, seed = build(args.max_tokens, max_batch, tmp)
        app = build_app(sampler, tok, admin_key=ADMIN, model_name=MODEL)
        url, stop = serve_in_thread(app)
        try:
            lat, tp = asyncio.run(run(args, url, sampler, prompt_ids, params))
        finally:
            stop()
            sampler.close()
    load = os.getloadavg()
    print(f"\ntiny model (hidden 64, 2 layers, vocab {tok.vocab_size}, seed {seed}), prompt "
          f"{len(prompt_ids)} tokens, greedy, max_tokens {args.max_tokens}; cpus {os.cpu_count()}, "
          f"load average {load[0]:.1f}")
    print("\nlatency, one request at a time (diff = HTTP minus the paired direct call)")
    print_table(lat, ["impl", "n", "p50_ms", "p99_ms", "mean_ms", "diff_p50_ms", "diff_p99_ms"])
    print("\nthroughput, C concurrent clients")
    print_table(tp, ["impl", "clients", "requests", "wall_s", "req_per_s", "out_tok_per_s",
                     "compiles"])
    write_json(args.out, {"benchmark": "endpoint", "config": vars(args), "model_seed": seed,
                          "prompt_tokens": len(prompt_ids), "load_average": load,
                          "latency": lat, "throughput": tp})
    return lat, tp


if __name__ == "__main__":
    main()
