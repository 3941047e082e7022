"""The fault soak: the split RL job under many injected faults (tests/support/fault_harness.py).

Runs seed S, S+1, ... (each a fresh job of `--steps` toy RL steps with
`--per_run` faults drawn by its seed, every kind alike) until `--faults`
faults were injected; checks every invariant after each run; writes one JSON
report (per run and in total: faults by kind and outcome, rollouts by fate,
violations, the machine) and prints a summary.

    python -m benchmarks.fault_soak --faults 200 --seed 100 --out bench_results/fault_soak.json

The correctness alarms (issue 65) are on in the learner and the collector as in any
run; each run's process logs are read for ALARM lines, counted per alarm and process
(`alarms`: none is the expected outcome of every fault the plan draws, which all
recover in seconds). `--stall_collector_s S` adds one fault that should fire: the
collector stopped (SIGSTOP) for S seconds, past a hang threshold set below it with
`--flag=--config.alarms.hang_s=...` (`--flag` passes a flag to both processes).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import machine  # noqa: E402
from tests.support.fault_harness import KINDS, Fault, run_seed  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--faults", type=int, default=200,
                   help="run seeds until at least this many faults were applied")
    p.add_argument("--seed", type=int, default=100, help="first seed")
    p.add_argument("--steps", type=int, default=8, help="toy RL steps per run")
    p.add_argument("--per_run", type=int, default=3 * len(KINDS), help="faults per run")
    p.add_argument("--mean_gap_s", type=float, default=2.5)
    p.add_argument("--workdir", default=None, help="kept for inspection (default: a temp dir)")
    p.add_argument("--out", default=None)
    p.add_argument("--flag", action="append", default=[],
                   help="a flag for the learner and the collector, e.g. "
                        "--flag=--config.alarms.hang_s=20 (repeatable)")
    p.add_argument("--deadline_s", type=float, default=600.0,
                   help="each run's deadline (a loaded machine needs more)")
    p.add_argument("--stall_collector_s", type=float, default=0.0,
                   help="add a collector SIGSTOP of this many seconds to every run (0: none)")
    a = p.parse_args(argv)
    extra = (Fault("pause_collector", 3.0, hold_s=a.stall_collector_s),) \
        if a.stall_collector_s > 0 else ()
    alarms: collections.Counter = collections.Counter()
    base = a.workdir or tempfile.mkdtemp(prefix="fault_soak_")
    runs, total, seed, t0 = [], collections.Counter(), a.seed, time.time()
    fates: collections.Counter = collections.Counter()
    while sum(n for k, n in total.items() if "skipped" not in k) < a.faults:
        w = os.path.join(base, f"seed{seed}")
        t1 = time.time()
        try:
            rep = run_seed(w, seed, steps=a.steps, faults=a.per_run, mean_gap_s=a.mean_gap_s,
                           scripted=seed == a.seed, log=lambda m: print(m, flush=True),
                           flags=tuple(a.flag), extra=extra, deadline_s=a.deadline_s)
        except Exception as e:  # noqa: BLE001 - a stalled or broken run is a finding: recorded
            rep = {"seed": seed, "violations": [f"run failed: {type(e).__name__}: {e}"[:3000]],
                   "faults": {}, "rollouts": {}}
        rep["wall_s"] = time.time() - t1
        rep["alarms"] = alarm_lines(w)
        alarms.update(f"{line.split()[1]} in {role}" for role, line in rep["alarms"])
        rep.pop("unexpected", None)
        runs.append(rep)
        total.update(rep["faults"])
        fates.update(rep["rollouts"])
        print(f"seed {seed}: {sum(rep['faults'].values())} faults, violations "
              f"{rep['violations']}, {rep['wall_s']:.0f} s", flush=True)
        if not a.workdir and not rep["violations"]:
            shutil.rmtree(w, ignore_errors=True)
        seed += 1
        if a.out:  # after every run: a stopped soak keeps what it did
            _write(a, runs, total, fates, t0, alarms)
    out = _write(a, runs, total, fates, t0, alarms)
    print(json.dumps({k: out[k] for k in ("faults_injected", "faults_by_kind",
                                          "faults_by_outcome", "rollouts", "runs_with_violations",
                                          "alarms", "wall_s")}, indent=1))
    return out


def alarm_lines(workdir: str) -> list[tuple[str, str]]:
    """(process log, line) of every ALARM line the run's processes logged."""
    logs = os.path.join(workdir, "logs")
    out = []
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else []:
        with open(os.path.join(logs, name), errors="replace") as f:
            for line in f:
                at = line.find("ALARM ")
                if at >= 0:
                    out.append((name, line[at:].strip()))
    return out


def _write(a, runs, total, fates, t0, alarms) -> dict:
    by_kind = collections.Counter()
    for k, n in total.items():
        by_kind[k.split(":")[0]] += n
    out = {"benchmark": "fault_soak", "config": vars(a), "machine": machine(),
           "date": time.strftime("%Y-%m-%d %H:%M"), "wall_s": time.time() - t0,
           "faults_injected": sum(total.values()),
           "faults_applied": sum(n for k, n in total.items() if "skipped" not in k),
           "faults_by_kind": dict(by_kind), "faults_by_outcome": dict(total),
           "rollouts": dict(fates), "alarms": dict(alarms), "runs": runs,
           "runs_with_violations": [r["seed"] for r in runs if r["violations"]]}
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
