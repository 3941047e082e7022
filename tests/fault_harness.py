"""Fault injection for the split RL job (issue 42): real processes, random faults, invariants.

`FaultJob` runs the split job of `experiments.rl_split` (toy config, random tiny
policy, AlternatingEnv) as real processes: two sampler backends (`python -m
ac2_jax.serving.backend`), the endpoint over them (`python -m ac2_jax.serving
--backends=...`, a FleetSampler), a collector and a learner (`tests/fault_worker.py`,
which journals every rollout the collector starts). A seed (`plan`) picks the
faults and when they strike:

  kill_learner / kill_collector    SIGKILL, then started again
  pause_learner / pause_collector  SIGSTOP for a while, then SIGCONT
  restart_endpoint                 SIGKILL of the endpoint, started again on its port
  hang_backend                     SIGSTOP of one fleet backend for longer than the
                                   endpoint's backend timeout, then SIGCONT
  disk_full                        the collector restarted under a disk quota on the
                                   trace store (`quota_open`: ENOSPC once the store's
                                   files would pass it); it must stop with a clear
                                   error, the store holding every byte written before;
                                   then started again without the quota

`check` then reads what the run left and returns every invariant's verdict
(`violations` lists the broken ones): each rollout the collector started was
trained once or skipped with a reason; no trace stored twice; the learner's
steps contiguous across restarts; its final weights equal a fault-free learner
replayed on the same stored batches (`fault_worker.py replay`, fp32, exact); the
endpoint only ever served finalized publishes and ends on the newest; every
full disk a clear error that lost nothing. Bounded in time: each wait has a
deadline. The suite runs fixed seeds (tests/training/rl/test_faults.py), the
soak many more (benchmarks/fault_soak.py).
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import errno
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "fault_worker.py")
ADMIN = "sk-admin-faults"
CONFIG = "experiments/configs/rl_split.py:toy"
KINDS = ("kill_learner", "kill_collector", "pause_learner", "pause_collector",
         "restart_endpoint", "hang_backend", "disk_full")


# ------------------------------------------------------------------ a full disk

def prefix_bytes(prefix: str) -> int:
    """Bytes of the files whose path starts with `prefix` (the store and its markers)."""
    d, stem = os.path.split(prefix)
    total = 0
    for root, _, files in os.walk(d):
        for n in files:
            p = os.path.join(root, n)
            if p.startswith(prefix):
                try:
                    total += os.path.getsize(p)
                except OSError:
                    pass
    return total


class _QuotaFile:
    def __init__(self, f, name: str, prefix: str, quota: int):
        self._f, self._name, self._prefix, self._quota = f, name, prefix, quota

    def write(self, s):
        self._f.flush()
        data = s.encode() if isinstance(s, str) else s
        room = self._quota - prefix_bytes(self._prefix)
        if len(data) <= room:
            return self._f.write(s)
        if room > 0:  # the disk takes what fits, as a real one does
            cut = data[:room]
            self._f.write(cut.decode(errors="ignore") if isinstance(s, str) else cut)
            self._f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._name)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def quota_open(prefix: str, quota: int):
    """An `open` whose writes to files under path `prefix` fail with ENOSPC once
    those files would hold more than `quota` bytes (tests only)."""
    prefix = os.path.abspath(prefix)

    def opener(file, mode="r", *args, **kw):
        f = builtins.open(file, mode, *args, **kw)
        if any(c in mode for c in "wax+") and os.path.abspath(os.fspath(file)).startswith(prefix):
            return _QuotaFile(f, os.fspath(file), prefix, quota)
        return f

    return opener


# ------------------------------------------------------------------ the plan

@dataclasses.dataclass
class Fault:
    kind: str
    gap_s: float  # after the previous fault ended
    hold_s: float = 0.0  # pause / hang length
    pick: int = 0  # which backend; the quota's headroom
    outcome: str = "pending"


def plan(seed: int, n: int, mean_gap_s: float = 4.0, kinds=KINDS,
         collector_first: bool = False) -> list[Fault]:
    """n faults, every kind at least once when n >= len(kinds), order and times by seed.
    collector_first: the collector's faults before the others (it exits once the last
    step is marked, well before the learner: a short run would skip them)."""
    rng = random.Random(seed)
    ks = [kinds[i % len(kinds)] for i in range(n)]
    rng.shuffle(ks)
    if collector_first:
        ks.sort(key=lambda k: k not in ("kill_collector", "pause_collector", "disk_full"))
    out = []
    for k in ks:
        hold = rng.uniform(0.5, 3.0) if k.startswith("pause") else rng.uniform(5.0, 8.0)
        out.append(Fault(k, rng.uniform(0.5, 2 * mean_gap_s), hold if k.startswith(
            ("pause", "hang")) else 0.0, rng.randrange(1 << 16)))
    return out


def _reads_strictly(path: str) -> bool:
    """The store reads with strict errors (no torn line) past the lines a kill tore."""
    from ac2_jax.trace.store import _parse_line
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    if not lines:
        return True
    try:
        _parse_line(lines[-1])
        return True
    except Exception:  # noqa: BLE001 - a torn last line
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ processes

class Role:
    """One process of the job, started again as often as needed (each run logged)."""

    def __init__(self, name: str, argv: list[str], logdir: str):
        self.name, self.argv, self.logdir = name, argv, logdir
        self.proc: subprocess.Popen | None = None
        self.runs: list[dict[str, Any]] = []  # pid, log, why it ended

    def start(self, extra_env: dict[str, str] | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, **(extra_env or {}))
        log = os.path.join(self.logdir, f"{self.name}.{len(self.runs)}.log")
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env=env, stdout=f,
                                         stderr=subprocess.STDOUT)
        self.runs.append({"pid": self.proc.pid, "log": log, "end": None, "rc": None})

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def done(self) -> bool:  # finished its work
        return self.proc is not None and self.proc.poll() == 0

    def signal(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    def kill(self, why: str) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=60)
            self.runs[-1].update(end=why, rc=self.proc.returncode)

    def reap(self) -> int | None:
        """The exit code once it exited on its own (recorded), else None."""
        if self.proc is None or self.proc.poll() is None or self.runs[-1]["end"]:
            return None
        rc = self.proc.returncode
        self.runs[-1].update(end="exited", rc=rc)
        return rc

    def log(self, i: int = -1) -> str:
        with open(self.runs[i]["log"], errors="replace") as f:
            return f.read()


class FaultJob:
    """The split job under faults (module docstring). `run(faults)` then `check()`."""

    def __init__(self, workdir: str, *, steps: int = 3, seed: int = 0,
                 backend_timeout_s: float = 3.0, deadline_s: float = 600.0, log=print):
        self.w, self.steps, self.seed = os.path.abspath(workdir), steps, seed
        self.rng = random.Random(seed ^ 0x5EED)
        self.deadline = time.monotonic() + deadline_s
        self.say = log
        self.logs = os.path.join(self.w, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.rl = os.path.join(self.w, "rl")
        self.store_path = os.path.join(self.rl, "rollouts.jsonl")
        self.journal = os.path.join(self.w, "journal.jsonl")
        self.published = os.path.join(self.rl, "published")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.policy = self._prepare()
        ports = [free_port(), free_port()]
        py = sys.executable
        self.backends = [Role(f"backend{i}", [py, "-m", "ac2_jax.serving.backend",
                                              f"--model={self.policy}", f"--port={p}",
                                              "--max_batch=8", "--max_context=128"], self.logs)
                         for i, p in enumerate(ports)]
        self.backend_urls = [f"http://127.0.0.1:{p}" for p in ports]
        self.endpoint = Role("endpoint", [
            py, "-m", "ac2_jax.serving", f"--model={self.policy}", f"--port={self.port}",
            f"--publish_dir={self.published}", f"--export_dir={os.path.join(self.w, 'export')}",
            f"--backends={','.join(self.backend_urls)}", f"--backend_timeout_s={backend_timeout_s}",
            f"--admin_key={ADMIN}", "--max_context=128"], self.logs)
        role = [py, WORKER, f"--config={CONFIG}", f"--config.workdir={self.w}",
                "--config.env.kind=alternating", f"--config.rl.steps={steps}",
                "--config.split.wait_timeout_s=300", f"--admin_key={ADMIN}",
                f"--endpoint={self.url}"]
        self.collector = Role("collector", role + ["--role=collect"], self.logs)
        self.learner = Role("learner", role + ["--role=learn"], self.logs)
        self.served: list[dict[str, Any]] = []  # polls: served version, finalized steps then
        self.finalized_ever: set[int] = set()
        self.unexpected: list[dict[str, Any]] = []
        self.disk_full: list[dict[str, Any]] = []
        self.faults: list[Fault] = []
        self.restarted_after_learner = False  # the endpoint: then it knows no learner_step
        self.admin = httpx.Client(base_url=self.url, timeout=10,
                                  headers={"Authorization": f"Bearer {ADMIN}"})

    def _prepare(self) -> str:
        from experiments import rl_split
        from experiments.configs.rl_split import get_config
        cfg = get_config("toy")
        cfg.workdir, cfg.env.kind = self.w, "alternating"
        with open(os.path.join(self.w, "fault_config.json"), "w") as f:
            json.dump({"steps": self.steps, "seed": self.seed}, f)
        return rl_split.prepare(cfg, log=lambda _: None)

    # -- running

    def _env(self) -> dict[str, str]:
        return {"AC2_FAULT_JOURNAL": self.journal}

    def _wait_http(self, url: str, path: str, role: Role, timeout_s: float = 180.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if not role.alive:
                raise RuntimeError(f"{role.name} exited: {role.log()[-3000:]}")
            try:
                r = httpx.get(url + path, timeout=5, headers={"Authorization": f"Bearer {ADMIN}"})
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{role.name} did not answer {path} in {timeout_s} s")

    def start(self) -> None:
        for b in self.backends:
            b.start()
        for b, u in zip(self.backends, self.backend_urls, strict=True):
            self._wait_http(u, "/get_model_info", b)
        self.endpoint.start()
        self._wait_http(self.url, "/v1/models", self.endpoint)
        self.collector.start(self._env())
        self.learner.start(self._env())

    def _finalized(self) -> set[int]:
        try:
            return {int(n) for n in os.listdir(self.published) if n.isdigit()}
        except FileNotFoundError:
            return set()

    def tick(self) -> None:
        """One look: what the endpoint serves, and any role that died on its own."""
        self.finalized_ever |= self._finalized()
        if self.endpoint.alive:
            try:
                e = self.admin.get("/v1/models").json()["data"][0]
                fin = self._finalized()
                self.finalized_ever |= fin
                self.served.append({"t": time.monotonic(), "version": e["policy_version"],
                                    "learner_step": e.get("learner_step"),
                                    "finalized": sorted(fin)})
            except (httpx.HTTPError, ValueError, KeyError):
                pass
        for r in (self.collector, self.learner, self.endpoint, *self.backends):
            rc = r.reap()
            if rc is not None and rc != 0:  # nothing we injected: a finding; start it again
                self.unexpected.append({"role": r.name, "rc": rc, "log": r.log()[-3000:]})
                self.say(f"UNEXPECTED exit of {r.name} rc={rc}")
                r.start(self._env() if r in (self.collector, self.learner) else None)
            elif rc == 0 and r not in (self.collector, self.learner):
                self.unexpected.append({"role": r.name, "rc": 0, "log": r.log()[-3000:]})

    def sleep(self, s: float) -> None:
        end = time.monotonic() + s
        while time.monotonic() < end:
            self.tick()
            time.sleep(min(0.25, max(0.0, end - time.monotonic())))
        if time.monotonic() > self.deadline:
            raise TimeoutError("fault job past its deadline")

    def apply(self, f: Fault) -> None:
        target = {"kill_learner": self.learner, "pause_learner": self.learner,
                  "kill_collector": self.collector, "pause_collector": self.collector,
                  "disk_full": self.collector}.get(f.kind)
        if target is not None and (target.done or not target.alive):
            f.outcome = "skipped: process already done"
            return
        if f.kind.startswith("kill_"):
            target.kill(f.kind)
            self.sleep(self.rng.uniform(0.0, 0.5))
            target.start(self._env())
        elif f.kind.startswith("pause_"):
            target.signal(signal.SIGSTOP)
            time.sleep(f.hold_s)
            target.signal(signal.SIGCONT)
        elif f.kind == "restart_endpoint":
            self.restarted_after_learner |= self.learner.done
            self.endpoint.kill(f.kind)
            self.sleep(self.rng.uniform(0.0, 0.5))
            self.endpoint.start()
            self._wait_http(self.url, "/v1/models", self.endpoint)
        elif f.kind == "hang_backend":
            b = self.backends[f.pick % len(self.backends)]
            b.signal(signal.SIGSTOP)
            self.sleep(f.hold_s)
            b.signal(signal.SIGCONT)
        elif f.kind == "disk_full":
            self._disk_full(f)
        if f.outcome == "pending":
            f.outcome = "applied"

    def _disk_full(self, f: Fault) -> None:
        self.collector.kill("disk_full (restarted under a quota)")
        prefix = os.path.join(self.rl, "rollouts")
        quota = prefix_bytes(prefix) + 300 + f.pick % 4000
        before = open(self.store_path, "rb").read() if os.path.exists(self.store_path) else b""
        self.collector.start({**self._env(), "AC2_FAULT_QUOTA": f"{quota}:{prefix}"})
        end = time.monotonic() + 90
        while self.collector.alive and time.monotonic() < end:
            self.sleep(0.25)
        rec: dict[str, Any] = {"quota": quota, "bytes_before": len(before)}
        if self.collector.alive:  # never reached the quota in time: stop it, note it
            self.collector.kill("disk_full: quota not reached")
            rec["outcome"] = "quota not reached"
        elif self.collector.done:
            rec["outcome"] = "finished within the quota"
        else:
            self.collector.reap()
            self.collector.runs[-1]["end"] = "disk_full"
            text = self.collector.log()
            after = open(self.store_path, "rb").read()
            rec.update(outcome="ENOSPC", rc=self.collector.proc.returncode,
                       clear_error="No space left on device" in text,
                       store_error="TraceStore: could not append" in text,
                       kept_prefix=after.startswith(before), bytes_after=len(after),
                       no_torn_line=_reads_strictly(self.store_path),
                       error=(re.findall(r"^\w*Error: .*$", text, re.M) or ["?"])[-1][:400])
        self.disk_full.append(rec)
        f.outcome = rec["outcome"]
        if not self.collector.done:
            self.collector.start(self._env())

    def _until(self, what: str, ok, timeout_s: float = 90.0) -> None:
        end = time.monotonic() + timeout_s
        while not ok():
            if time.monotonic() > end:
                raise TimeoutError(f"stalled: {what} not within {timeout_s} s; learner log: "
                                   f"{self.learner.log()[-2000:]}\ncollector log: "
                                   f"{self.collector.log()[-2000:]}")
            self.sleep(0.1)

    def _learner_step(self) -> int:
        return max([p["learner_step"] or 0 for p in self.served[-1:]], default=0)

    def endpoint_forgets(self) -> None:
        """The scripted faults first: the collector killed once step 0 is marked; once
        the learner has trained step 0 (and waits for step 1) the endpoint restarts,
        forgetting learner_step, and then the collector starts again (it waits for
        learner_step >= 1: a learner that never tells the new endpoint again would
        wait for step 1's marker for good)."""
        marker = os.path.join(self.rl, "rollouts.steps", "{}.json")
        self._until("rl_step 0 marked", lambda: os.path.exists(marker.format(0)), 180)
        self.collector.kill("kill_collector")
        self._until("learner_step 1", lambda: self._learner_step() >= 1, 120)
        self.endpoint.kill("restart_endpoint")
        self.endpoint.start()
        self._wait_http(self.url, "/v1/models", self.endpoint)
        self.collector.start(self._env())
        self.faults += [Fault("kill_collector", 0.0, outcome="applied (scripted)"),
                        Fault("restart_endpoint", 0.0, outcome="applied (scripted)")]
        self._until("rl_step 1 marked after the endpoint restart",
                    lambda: os.path.exists(marker.format(1)), 90)

    def run(self, faults: list[Fault], finish_s: float = 300.0, scripted: bool = False) -> None:
        self.faults = []
        self.start()
        if scripted:
            self.endpoint_forgets()
        self.faults += faults
        for f in faults:
            self.sleep(f.gap_s)
            self.say(f"fault {f.kind} (hold {f.hold_s:.1f} s)")
            self.apply(f)
        end = min(self.deadline, time.monotonic() + finish_s)
        while not (self.learner.done and self.collector.done):
            if time.monotonic() > end:
                raise TimeoutError(
                    f"the job did not finish {finish_s} s after its last fault; learner log: "
                    f"{self.learner.log()[-3000:]}\ncollector log: {self.collector.log()[-3000:]}")
            self.sleep(0.25)
        self.sleep(3.0)  # a hung backend's revival (probe + load) after its SIGCONT

    def stop(self) -> None:
        for r in (self.learner, self.collector, self.endpoint, *self.backends):
            r.signal(signal.SIGCONT)
            r.kill("stopped")
        self.admin.close()

    # -- invariants

    def replay(self) -> dict[str, Any]:
        out = os.path.join(self.w, "replay.json")
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.update(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
        p = subprocess.run([sys.executable, WORKER, "replay", self.w, out], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            return {"error": (p.stdout + p.stderr)[-3000:]}
        return json.load(open(out))

    def check(self, final: dict[str, Any] | None = None) -> dict[str, Any]:
        import warnings

        from ac2_jax.trace import TraceStore
        from ac2_jax.training.rl.split import StepMarkers
        v: list[str] = []
        store = TraceStore(self.store_path)
        with warnings.catch_warnings(record=True) as torn:
            warnings.simplefilter("always")
            traces = store.read(on_error="skip")
        markers = StepMarkers.of(store)
        if markers.steps() != list(range(self.steps)):
            v.append(f"marked steps {markers.steps()} != 0..{self.steps - 1}")
        # No trace stored twice: one line per (step, task, attempt), one per endpoint rollout.
        keys = collections.Counter((t.metadata.get("rl_step"), t.task_id, t.metadata.get("attempt"))
                                   for t in traces)
        twice = {k: n for k, n in keys.items() if n > 1}
        rids = collections.Counter(t.metadata.get("rollout_id") for t in traces
                                   if t.metadata.get("rollout_id"))
        if twice or any(n > 1 for n in rids.values()):
            v.append(f"stored twice: {list(twice)[:5]} {[r for r, n in rids.items() if n > 1][:5]}")
        final_by_key = {(t.metadata.get("rl_step"), t.task_id, t.metadata.get("attempt")): t
                        for t in traces}
        for s in range(self.steps):
            m = markers.read(s) or {}
            have = sum(1 for k in final_by_key if k[0] == s)
            if m.get("traces") != have:
                v.append(f"rl_step {s}: marker says {m.get('traces')} traces, store holds {have}")
        # Every rollout the collector started: trained once, or skipped with a reason.
        died = {r["pid"] for r in self.collector.runs if r["end"] not in (None, "exited")
                or r["rc"] not in (0, None)}
        journal = [json.loads(x) for x in open(self.journal)] if os.path.exists(
            self.journal) else []
        ends = {j["rollout_id"]: j["status"] for j in journal if j["event"] == "end"
                and j.get("rollout_id")}
        fate: collections.Counter = collections.Counter()
        for j in (j for j in journal if j["event"] == "start"):
            t = final_by_key.get((j["rl_step"], j["task"], j["attempt"]))
            if t is not None and t.metadata.get("rollout_id") == j["rollout_id"]:
                fate["trained" if t.status != "infra_error" else "skipped: infra_error"] += 1
            elif ends.get(j["rollout_id"]) == "infra_error":
                fate["skipped: infra_error, retried"] += 1
            elif j["pid"] in died:
                fate["skipped: collector died before storing it"] += 1
            else:
                fate["VIOLATION: started, never stored, not accounted"] += 1
                v.append(f"rollout {j['rollout_id']} (rl_step {j['rl_step']}, {j['task']} "
                         f"attempt {j['attempt']}) started by a live collector, never stored")
        started = {j["rollout_id"] for j in journal if j["event"] == "start"}
        unknown = [k for k, t in final_by_key.items()
                   if t.status != "infra_error" and t.metadata.get("rollout_id") not in started]
        if unknown:
            v.append(f"stored traces of no journaled rollout: {unknown[:5]}")
        # The learner's steps: contiguous across restarts (a resume repeats at most the
        # step whose checkpoint the kill interrupted), all of them trained.
        metrics = [json.loads(x) for x in open(os.path.join(self.rl, "metrics", "metrics.jsonl"))]
        seq = [int(m["train/rl_step"]) for m in metrics]
        if not seq or seq[0] != 0 or seq[-1] != self.steps - 1 or any(
                b - a not in (0, 1) for a, b in zip(seq, seq[1:], strict=False)):
            v.append(f"learner steps not contiguous: {seq}")
        last = {int(m["train/rl_step"]): m for m in metrics}
        for s, m in last.items():
            mk = markers.read(s) or {}
            if m["train/traces"] != mk.get("traces"):
                v.append(f"rl_step {s}: trained {m['train/traces']} traces of {mk.get('traces')}")
        # Served: only ever a finalized publish; at the end the newest, on every backend.
        bad = [p for p in self.served if p["version"] not in self.finalized_ever | {0}]
        if bad:
            v.append(f"served versions never finalized: {bad[:3]}")
        final = final or {}
        latest = max(self._finalized(), default=None)
        told = final.get("learner_step")
        if final.get("policy_version") != latest or not (
                told == self.steps or (told is None and self.restarted_after_learner)):
            v.append(f"endpoint ends on {final}, latest publish {latest}")
        for b in (final.get("sampler_stats") or {}).get("backends", []):
            if not b["up"] or b["policy_version"] != latest:
                v.append(f"backend {b['name']} ends up={b['up']} at {b['policy_version']}")
        partial = [n for n in os.listdir(self.published) if not n.isdigit()]
        rep = self.replay()
        if rep.get("max_abs_diff") != 0.0:
            v.append(f"final weights differ from the fault-free replay: {rep}")
        for d in self.disk_full:
            if d["outcome"] == "ENOSPC" and not (d["clear_error"] and d["store_error"]
                                                 and d["kept_prefix"] and d["no_torn_line"]):
                v.append(f"full disk: {d}")
        if self.unexpected:
            v.append(f"unexpected exits: {[(u['role'], u['rc']) for u in self.unexpected]}")
        kinds = collections.Counter(f"{f.kind}: {f.outcome}" for f in self.faults)
        return {"seed": self.seed, "steps": self.steps, "violations": v,
                "faults": dict(kinds), "rollouts": dict(fate),
                "traces": len(traces), "torn_lines_skipped": len(torn),
                "stored_infra_errors": sum(t.status == "infra_error"
                                           for t in final_by_key.values()),
                "learner_runs": len(self.learner.runs), "collector_runs": len(self.collector.runs),
                "learner_steps_logged": seq, "served_polls": len(self.served),
                "served_versions": sorted({p["version"] for p in self.served}),
                "partial_publish_dirs_left": partial, "disk_full": self.disk_full,
                "replay": rep, "unexpected": self.unexpected}

    def final_state(self) -> dict[str, Any]:
        return self.admin.get("/v1/models").json()["data"][0]


def run_seed(workdir: str, seed: int, *, steps: int = 3, faults: int | None = None,
             mean_gap_s: float = 4.0, scripted: bool = False, collector_first: bool = False,
             log=print) -> dict[str, Any]:
    """One job under `plan(seed, faults)` (after `endpoint_forgets` when scripted);
    returns `check`'s report."""
    job = FaultJob(workdir, steps=steps, seed=seed, log=log)
    try:
        job.run(plan(seed, len(KINDS) if faults is None else faults, mean_gap_s,
                     collector_first=collector_first), scripted=scripted)
        final = job.final_state()
    finally:
        job.stop()
    return job.check(final)
