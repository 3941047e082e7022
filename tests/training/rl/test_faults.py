"""The split RL job under injected faults (tests/support/fault_harness.py), fixed seeds.

Each seed runs the real processes (two sampler backends, the endpoint over them as
a fleet, the collector, the learner) for 5 toy RL steps; first the scripted
faults (`FaultJob.endpoint_forgets`: the endpoint restarted while the learner waits
for the collector, which waits for the endpoint to report the learner's step: the
two waited for each other for good before `run_learner` told a restarted endpoint
again), then one fault of every kind (kill and pause of learner and collector, an
endpoint restart, a hung fleet backend, a full disk under the trace store) at
points the seed chooses (the collector's first: it finishes before the learner, then
the learner's);
then every invariant of `FaultJob.check` must hold: each rollout the collector
started trained once or skipped with its reason, no trace stored twice, the
learner's steps contiguous, its final weights exactly those of a fault-free
learner replayed on the same stored batches, only finalized publishes served and
the newest at the end, a full disk a clear error that lost nothing. The soak
(benchmarks/fault_soak.py) runs the same harness over many seeds.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.support.fault_harness import KINDS, plan, run_seed  # noqa: E402

SEEDS = [4]
STEPS = 5


def test_a_plan_covers_every_kind_and_is_fixed_by_its_seed():
    a, b = plan(7, len(KINDS)), plan(7, len(KINDS))
    assert sorted(f.kind for f in a) == sorted(KINDS)
    assert [(f.kind, f.gap_s, f.hold_s) for f in a] == [(f.kind, f.gap_s, f.hold_s) for f in b]
    assert [f.kind for f in plan(8, len(KINDS))] != [f.kind for f in a]


@pytest.mark.parametrize("seed", SEEDS)
def test_the_split_job_keeps_its_invariants_under_every_kind_of_fault(tmp_path, seed):
    report = run_seed(str(tmp_path / "job"), seed, steps=STEPS, mean_gap_s=0.5, scripted=True,
                      collector_first=True, log=lambda _: None)
    summary = {k: report[k] for k in ("violations", "faults", "rollouts", "learner_steps_logged",
                                      "disk_full", "replay")}
    assert report["violations"] == [], json.dumps(summary, indent=1, default=str)
    # Every attempt stored once: trained, or an infra_error (retries used up), never trained.
    assert report["traces"] == STEPS * 2 * 4
    assert report["rollouts"].get("trained", 0) == STEPS * 2 * 4 - report["stored_infra_errors"]
    assert report["replay"]["max_abs_diff"] == 0.0  # fp32, exact
    # The scripted two (kill_collector, restart_endpoint) and the seed's 7, one of each kind;
    # a fault whose process had already finished its work is skipped, and says so.
    assert sum(report["faults"].values()) == len(KINDS) + 2
    # Seed 4 strikes the collector's disk first (it still has steps 2-4 to store): the
    # full disk is hit for sure; the endpoint and the backends are up all along. The
    # others land while their process still works, unless a fast machine finished first.
    faults = report["faults"]
    assert faults.get("disk_full: ENOSPC") == 1, faults
    assert faults.get("restart_endpoint: applied") == faults.get("hang_backend: applied") == 1
