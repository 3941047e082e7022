"""The invariants checked after each fault run (tests/support/fault_harness.py's `FaultJob`):
`check(job, final)` returns every verdict, `violations` listing the broken ones."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from typing import Any

from tests.support.child_env import child_env
from tests.support.fault_procs import ROOT

WORKER = os.path.join(ROOT, "tests", "support", "fault_worker.py")


def replay(job) -> dict[str, Any]:
    out = os.path.join(job.w, "replay.json")
    env = child_env(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    p = subprocess.run([sys.executable, WORKER, "replay", job.w, out], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        return {"error": (p.stdout + p.stderr)[-3000:]}
    return json.load(open(out))


def check(job, final: dict[str, Any] | None = None) -> dict[str, Any]:
    import warnings

    from ac2_jax.trace import TraceStore
    from ac2_jax.training.rl.split import StepMarkers
    v: list[str] = []
    store = TraceStore(job.store_path)
    with warnings.catch_warnings(record=True) as torn:
        warnings.simplefilter("always")
        traces = store.read(on_error="skip")
    markers = StepMarkers.of(store)
    if markers.steps() != list(range(job.steps)):
        v.append(f"marked steps {markers.steps()} != 0..{job.steps - 1}")
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
    for s in range(job.steps):
        m = markers.read(s) or {}
        have = sum(1 for k in final_by_key if k[0] == s)
        if m.get("traces") != have:
            v.append(f"rl_step {s}: marker says {m.get('traces')} traces, store holds {have}")
    # Every rollout the collector started: trained once, or skipped with a reason.
    died = {r["pid"] for r in job.collector.runs if r["end"] not in (None, "exited")
            or r["rc"] not in (0, None)}
    journal = [json.loads(x) for x in open(job.journal)] if os.path.exists(
        job.journal) else []
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
    metrics = [json.loads(x) for x in open(os.path.join(job.rl, "metrics", "metrics.jsonl"))]
    seq = [int(m["train/rl_step"]) for m in metrics]
    if not seq or seq[0] != 0 or seq[-1] != job.steps - 1 or any(
            b - a not in (0, 1) for a, b in zip(seq, seq[1:], strict=False)):
        v.append(f"learner steps not contiguous: {seq}")
    last = {int(m["train/rl_step"]): m for m in metrics}
    for s, m in last.items():
        mk = markers.read(s) or {}
        if m["train/traces"] != mk.get("traces"):
            v.append(f"rl_step {s}: trained {m['train/traces']} traces of {mk.get('traces')}")
    # Served: only ever a finalized publish; at the end the newest, on every backend.
    bad = [p for p in job.served if p["version"] not in job.finalized_ever | {0}]
    if bad:
        v.append(f"served versions never finalized: {bad[:3]}")
    final = final or {}
    latest = max(job._finalized(), default=None)
    told = final.get("learner_step")
    if final.get("policy_version") != latest or not (
            told == job.steps or (told is None and job.restarted_after_learner)):
        v.append(f"endpoint ends on {final}, latest publish {latest}")
    for b in (final.get("sampler_stats") or {}).get("backends", []):
        if not b["up"] or b["policy_version"] != latest:
            v.append(f"backend {b['name']} ends up={b['up']} at {b['policy_version']}")
    partial = [n for n in os.listdir(job.published) if not n.isdigit()]
    rep = job.replay()
    if rep.get("max_abs_diff") != 0.0:
        v.append(f"final weights differ from the fault-free replay: {rep}")
    for d in job.disk_full:
        if d["outcome"] == "ENOSPC" and not (d["clear_error"] and d["store_error"]
                                             and d["kept_prefix"] and d["no_torn_line"]):
            v.append(f"full disk: {d}")
    if job.unexpected:
        v.append(f"unexpected exits: {[(u['role'], u['rc']) for u in job.unexpected]}")
    kinds = collections.Counter(f"{f.kind}: {f.outcome}" for f in job.faults)
    return {"seed": job.seed, "steps": job.steps, "violations": v,
            "faults": dict(kinds), "rollouts": dict(fate),
            "traces": len(traces), "torn_lines_skipped": len(torn),
            "stored_infra_errors": sum(t.status == "infra_error"
                                       for t in final_by_key.values()),
            "learner_runs": len(job.learner.runs), "collector_runs": len(job.collector.runs),
            "learner_steps_logged": seq, "served_polls": len(job.served),
            "served_versions": sorted({p["version"] for p in job.served}),
            "partial_publish_dirs_left": partial, "disk_full": job.disk_full,
            "replay": rep, "unexpected": job.unexpected}
