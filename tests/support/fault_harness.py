"""Fault injection for the split RL job (issue 42): real processes, random faults, invariants.

`FaultJob` runs the split job of `experiments.rl_split` (toy config, random tiny
policy, AlternatingEnv) as real processes: two sampler backends (`python -m
ac2_jax.serving.backend`), the endpoint over them (`python -m ac2_jax.serving
--backends=...`, a FleetSampler), a collector and a learner (`tests/support/fault_worker.py`,
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

`check` (tests/support/fault_invariants.py; processes and the quota shim are in
tests/support/fault_procs.py) then reads what the run left and returns every invariant's verdict
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

import dataclasses
import json
import os
import random
import re
import signal
import sys
import time
from typing import Any

import httpx

from tests.support import fault_invariants  # noqa: E402
from tests.support.fault_procs import ROOT, Role, _reads_strictly, prefix_bytes, quota_open  # noqa: E402, F401
from tests.support.ports import reserved_port  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "support", "fault_worker.py")
ADMIN = "sk-admin-faults"
CONFIG = "experiments/rl_split/config.py:toy"
KINDS = ("kill_learner", "kill_collector", "pause_learner", "pause_collector",
         "restart_endpoint", "hang_backend", "disk_full")


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
    collector_first: the collector's faults first (it exits once the last step is
    marked, well before the learner: a short run would skip them), then the learner's,
    then the endpoint's and the backends' (up all along)."""
    rng = random.Random(seed)
    ks = [kinds[i % len(kinds)] for i in range(n)]
    rng.shuffle(ks)
    if collector_first:  # then the learner's, then the endpoint's and backends' (always up)
        ks.sort(key=lambda k: (k not in ("kill_collector", "pause_collector", "disk_full"))
                + (k in ("restart_endpoint", "hang_backend")))
    out = []
    for k in ks:
        hold = rng.uniform(0.5, 3.0) if k.startswith("pause") else rng.uniform(5.0, 8.0)
        out.append(Fault(k, rng.uniform(0.5, 2 * mean_gap_s), hold if k.startswith(
            ("pause", "hang")) else 0.0, rng.randrange(1 << 16)))
    return out


class FaultJob:
    """The split job under faults (module docstring). `run(faults)` then `check()`."""

    def __init__(self, workdir: str, *, steps: int = 3, seed: int = 0,
                 backend_timeout_s: float = 3.0, deadline_s: float = 600.0, log=print,
                 flags: tuple[str, ...] = ()):
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
        self.port = reserved_port()  # the endpoint restarts on it
        self.url = f"http://127.0.0.1:{self.port}"
        self.policy = self._prepare()
        ports = [reserved_port(), reserved_port()]
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
                f"--endpoint={self.url}", *flags]  # flags: e.g. --config.alarms.hang_s=20
        self.collector = Role("collector", role + ["--role=collect"], self.logs)
        self.learner = Role("learner", role + ["--role=learn"], self.logs)
        self.served: list[dict[str, Any]] = []  # polls: served version, finalized steps then
        self.finalized_ever: set[int] = set()
        self.unexpected: list[dict[str, Any]] = []
        # Roles whose exit a fault is waiting for and reaps itself (the collector under a
        # disk quota): `tick` leaves them alone. Reaped by `tick`, an ENOSPC exit that fell
        # between the fault's "still alive?" look and the tick's reap was counted an
        # unexpected exit and restarted without the quota.
        self.awaited: set[str] = set()
        self.disk_full: list[dict[str, Any]] = []
        self.faults: list[Fault] = []
        self.restarted_after_learner = False  # the endpoint: then it knows no learner_step
        self.admin = httpx.Client(base_url=self.url, timeout=10,
                                  headers={"Authorization": f"Bearer {ADMIN}"})

    def _prepare(self) -> str:
        from experiments.rl_split import run as rl_split
        from experiments.rl_split.config import get_config
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
        """The backends, then the endpoint over them once they answer. The collector and
        the learner start with the backends: each waits for the endpoint itself
        (`wait_for_endpoint`), so their start-up overlaps the servers'."""
        for b in self.backends:
            b.start()
        self.collector.start(self._env())
        self.learner.start(self._env())
        for b, u in zip(self.backends, self.backend_urls, strict=True):
            self._wait_http(u, "/get_model_info", b)
        self.endpoint.start()
        self._warm_up()
        self._wait_http(self.url, "/v1/models", self.endpoint)

    def _warm_up(self) -> None:
        """While the endpoint starts: each backend in turn decodes a burst like a step's
        first requests (4 at once, 27-token prompts, 6 tokens), so the collector's first
        requests do not wait out the backend timeout (3 s) on the compile, and the second
        backend reads the first's programs from the run's compile cache."""
        from concurrent.futures import ThreadPoolExecutor

        body = {"input_ids": list(range(3, 30)),
                "sampling_params": {"max_new_tokens": 6, "temperature": 1.0}}
        for u in self.backend_urls:
            with ThreadPoolExecutor(4) as pool:
                for r in pool.map(lambda _: httpx.post(u + "/generate", json=body, timeout=120),
                                  range(4)):
                    r.raise_for_status()

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
            if r.name in self.awaited:
                continue
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
            # After the learner's last tell (it may still be exiting) nobody tells the new
            # endpoint its learner_step: nothing is paced on it any more.
            self.restarted_after_learner |= self.learner.done or any(
                p["learner_step"] == self.steps for p in self.served)
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
        self.awaited.add(self.collector.name)
        try:
            while self.collector.alive and time.monotonic() < end:
                self.sleep(0.25)
        finally:
            self.awaited.discard(self.collector.name)
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
        # A hung backend's revival (probe + load) after its SIGCONT: until the endpoint
        # serves the newest publish on every backend, for at most 10 s (`check` then
        # reports what it saw).
        end = time.monotonic() + 10.0
        while time.monotonic() < end and not self._settled():
            self.sleep(0.1)

    def _settled(self) -> bool:
        """The endpoint serves the newest finalized publish, on every backend, all up."""
        try:
            e = self.final_state()
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        latest = max(self._finalized(), default=None)
        backends = (e.get("sampler_stats") or {}).get("backends", [])
        return e.get("policy_version") == latest and bool(backends) and all(
            b["up"] and b["policy_version"] == latest for b in backends)

    def stop(self) -> None:
        for r in (self.learner, self.collector, self.endpoint, *self.backends):
            r.signal(signal.SIGCONT)
            r.kill("stopped")
        self.admin.close()

    def replay(self) -> dict[str, Any]:
        return fault_invariants.replay(self)

    def check(self, final: dict[str, Any] | None = None) -> dict[str, Any]:
        """Every invariant's verdict (tests/support/fault_invariants.py)."""
        return fault_invariants.check(self, final)

    def final_state(self) -> dict[str, Any]:
        return self.admin.get("/v1/models").json()["data"][0]


def run_seed(workdir: str, seed: int, *, steps: int = 3, faults: int | None = None,
             mean_gap_s: float = 4.0, scripted: bool = False, collector_first: bool = False,
             log=print, flags: tuple[str, ...] = (), extra: tuple[Fault, ...] = (),
             deadline_s: float = 600.0) -> dict[str, Any]:
    """One job under `plan(seed, faults)` (after `endpoint_forgets` when scripted) and
    then the `extra` faults; `flags` go to the learner and the collector. Returns
    `check`'s report."""
    job = FaultJob(workdir, steps=steps, seed=seed, log=log, flags=flags, deadline_s=deadline_s)
    try:
        job.run(plan(seed, len(KINDS) if faults is None else faults, mean_gap_s,
                     collector_first=collector_first) + list(extra), scripted=scripted)
        final = job.final_state()
    finally:
        job.stop()
    return job.check(final)
