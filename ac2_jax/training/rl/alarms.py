"""Correctness alarms of an RL run, on by default (`AlarmsConfig`, the recipe's
`alarms` section; issue 65).

Each alarm is a metric, a threshold and an action: "warn" (one log line, the run
goes on), "stop" (the line, then `AlarmStop` ends the run) or "off" (not
checked). Every metric is in the step's metrics (`alarms/...`, so in
metrics.jsonl and TensorBoard) whether it fires or not; a fired alarm is one
line saying what, where, and the config key that turns it off, and is counted
(`alarms/fired/<name>`).

- weights: every publish carries a checksum of what it published
  (`models.weights_checksum`: the parameters, or a LoRA run's adapters); the
  sampler reports the checksum of what it serves for that version
  (`served_weights()`). A mismatch fires at once; a sampler still serving an
  older version `weights.deadline_s` after a publish fires too. A sampler that
  cannot report (SGLang) is counted (`alarms/weights_unverified`), never
  passed as verified.
- drift: the learner's log-probs of the sampled tokens at the weights that are
  about to train on them, against the log-probs the sampler recorded: mean
  |delta|, the k3 estimate of KL(sampler || learner) (and the max |delta| where
  drift takes a forward of its own: `drift_metrics`), for on-policy tokens
  (sampled by the learner's current version: same weights, so only numerics
  differ) and stale ones separately. On-policy mean |delta| above
  `drift.threshold` fires, naming the worst completions. Every
  `PolicyGradientLoss` kind measures it in the train step's own forward
  (`objectives.drift_sums`, the log-probs before the update): no extra forward.
- routing: for a mixture-of-experts policy whose traces record routing, the
  fraction of tokens whose learner top k differs from the recorded experts
  (`routing_mismatch`), with routing replay on or off (`rl.moe.routing`).
- hang: `Watchdog` (training.core.watchdog), per stage, `hang.threshold`
  seconds.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

ALARM_ACTIONS = ("warn", "stop", "off")
log = logging.getLogger("ac2_jax.alarms")


class AlarmStop(RuntimeError):
    """A fired alarm whose action is "stop"; the message is the alarm's line."""


@dataclasses.dataclass(frozen=True)
class AlarmConfig:
    """One alarm: fires when its metric passes `threshold`; `action` is what then
    happens ("warn", "stop", or "off": not checked)."""

    threshold: float
    action: str = "warn"

    def __post_init__(self):
        if self.action not in ALARM_ACTIONS:
            raise ValueError(f"alarm action must be one of {ALARM_ACTIONS}, got {self.action!r}")
        if not self.threshold >= 0:
            raise ValueError(f"alarm threshold must be >= 0, got {self.threshold}")


@dataclasses.dataclass(frozen=True)
class WeightsAlarmConfig(AlarmConfig):
    """weights served = weights published. threshold: checksum mismatches allowed (0:
    any fires); deadline_s: how long after a publish the sampler may still serve
    an older version."""

    threshold: float = 0.0
    action: str = "stop"
    deadline_s: float = 600.0


@dataclasses.dataclass(frozen=True)
class AlarmsConfig:
    """The run's correctness alarms (the RL recipe's `alarms` section; configs:
    `--config.alarms.drift.action=off`). Defaults:

    - weights (stop, 0 mismatches, deadline 600 s): serving other weights than
      published is always a bug, whatever the hardware.
    - drift (warn, on-policy mean |delta log-prob| > 0.1): the same weights give the
      same log-probs up to numerics (fp32 on CPU: ~1e-6; a bf16 sampler against an
      fp32 learner: ~1e-2); 0.1 is an order above bf16's. Warn, since a new kernel
      or dtype moves it; `action=stop` for a run that must not train on drift.
    - routing (warn, mismatch fraction > 0.1): the fraction of a MoE batch's tokens
      whose learner top k (in any MoE layer) differs from the recorded routing, with
      replay on or off (Megatron #4168: runs collapse without replay). bf16
      near-ties flip a few percent; 0.1 is past that. Warn: with replay on the
      learner trains through the recorded experts anyway.
    - hang (stop, 1800 s with no progress of a stage): the first compile and a
      long collection at real size take minutes, never half an hour of nothing.
    """

    enabled: bool = True
    weights: WeightsAlarmConfig = WeightsAlarmConfig()
    drift: AlarmConfig = AlarmConfig(threshold=0.1, action="warn")
    routing: AlarmConfig = AlarmConfig(threshold=0.1, action="warn")
    hang: AlarmConfig = AlarmConfig(threshold=1800.0, action="stop")
    # Completions named by a fired drift alarm (the largest mean |delta| first).
    worst: int = 3

    def on(self, name: str) -> bool:
        return self.enabled and getattr(self, name).action != "off"


class Alarms:
    """Fires alarms: one line per firing (logged at ERROR for stop, WARNING for
    warn), counted per alarm; "stop" then raises `AlarmStop`. `prefix` names the
    config section in the lines ("alarms" in the recipes)."""

    def __init__(self, config: AlarmsConfig | None = None, prefix: str = "alarms"):
        self.config = config if config is not None else AlarmsConfig()
        self.prefix = prefix
        self.fired: list[tuple[str, str]] = []  # (alarm, line)
        self.counts: dict[str, int] = {}

    def fire(self, name: str, what: str, where: str) -> str:
        """Says `what` at `where` for alarm `name`; raises AlarmStop if its action is stop."""
        action = getattr(self.config, name).action
        line = (
            f"ALARM {name} ({action}): {what} [{where}]; turn off with "
            f"--config.{self.prefix}.{name}.action=off"
        )
        self.fired.append((name, line))
        self.counts[name] = self.counts.get(name, 0) + 1
        (log.error if action == "stop" else log.warning)("%s", line)
        if action == "stop":
            raise AlarmStop(line)
        return line

    def metrics(self) -> dict[str, float]:
        return {f"alarms/fired/{k}": float(v) for k, v in sorted(self.counts.items())}


def drift_metrics(
    learner: np.ndarray,
    sampler: np.ndarray,
    mask: np.ndarray,
    segment_index: np.ndarray,
    on_policy: Sequence[bool],
    names: Sequence[str],
    worst: int = 3,
    token_on_policy: np.ndarray | None = None,
) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """Sampler/learner drift of one packed batch's trained tokens.

    learner, sampler: [R, L] log-probs of the targets (the learner's at the weights
    the step trains, the sampler's as recorded); mask [R, L] (> 0: a trained
    token); segment_index [R, L] (the batch's segment numbers; `on_policy[i]` /
    `names[i]` of segment i: whether it was sampled by the learner's version, and
    the completion it came from). token_on_policy [R, L] (bool; e.g. the batch's
    per-token `POLICY_VERSION` == the learner's version: in-flight weight updates
    change the version within a completion) replaces `on_policy` per token.
    Returns (metrics, worst on-policy completions as (name, mean |delta|), largest
    first).

    Metrics, per kind k in ("onpolicy", "stale"): drift/k_abs_mean (mean |delta|),
    drift/k_kl (mean k3 = exp(d) - 1 - d with d = learner - sampler, the estimate of
    KL(sampler || learner) that `kl_to_sampler` uses), drift/k_max (max |delta|),
    drift/k_tokens; a kind without tokens has only its token count (0).
    """
    m = np.asarray(mask) > 0
    d = np.asarray(learner, np.float64) - np.asarray(sampler, np.float64)
    seg = np.asarray(segment_index)
    on = np.asarray(list(on_policy), bool)
    if token_on_policy is not None:
        tok_on = np.asarray(token_on_policy, bool)
    elif on.size:
        tok_on = on[np.clip(seg, 0, on.size - 1)]
    else:
        tok_on = np.zeros_like(m)
    out: dict[str, float] = {}
    for kind, sel in (("onpolicy", m & tok_on), ("stale", m & ~tok_on)):
        x = d[sel]
        out[f"drift/{kind}_tokens"] = float(x.size)
        if x.size:
            out[f"drift/{kind}_abs_mean"] = float(np.abs(x).mean())
            out[f"drift/{kind}_kl"] = float((np.exp(x) - 1.0 - x).mean())
            out[f"drift/{kind}_max"] = float(np.abs(x).max())
    sel = m & tok_on
    per: list[tuple[str, float]] = []
    if sel.any():
        ids = seg[sel]
        sums = np.bincount(ids, np.abs(d[sel]), minlength=len(names))
        counts = np.bincount(ids, minlength=len(names))
        for i in map(int, np.flatnonzero(counts)):
            per.append((names[i] if i < len(names) else f"segment {i}", sums[i] / counts[i]))
        per.sort(key=lambda p: -p[1])
    return out, per[:worst]


def check_drift(
    alarms: Alarms,
    m: dict[str, Any],
    worst: list[tuple[str, float]],
    where: str,
    ranked_by: str | None = None,
):
    """Fires the drift alarm when the step's on-policy mean |delta| (in `m`) passes
    its threshold. `ranked_by`: what ranked `worst` when not the learner the metric
    measured (e.g. "the updated learner")."""
    cfg = alarms.config.drift
    value = m.get("drift/onpolicy_abs_mean")
    if not alarms.config.on("drift") or value is None or value <= cfg.threshold:
        return
    named = ", ".join(f"{n} ({v:.3g})" for n, v in worst)
    peak = m.get("drift/onpolicy_max")
    alarms.fire(
        "drift",
        f"sampler/learner drift at the same weights: mean |delta log-prob| {value:.3g} > "
        f"{cfg.threshold:g} over {int(m['drift/onpolicy_tokens'])} on-policy tokens"
        + ("" if peak is None else f" (max {peak:.3g})")
        + f"; worst completions{'' if ranked_by is None else ' by ' + ranked_by}: {named}",
        where,
    )


def routing_mismatch(experts: np.ndarray, recorded: np.ndarray, real: np.ndarray) -> dict:
    """MoE routing mismatch of a packed batch: experts [R, L, n, k], the top k the
    learner routes each token to in each of its n MoE layers (`RouterStats.experts`
    of a forward without replay); recorded [R, L, n, k], what the sampler routed
    (`PackedBatch.routing`, -1: not recorded); real [R, L] (non-padding). A token
    mismatches when any layer's set of k experts differs. Returns routing/mismatch
    (fraction of recorded tokens), routing/layer_mismatch (fraction of recorded
    (token, layer) pairs) and routing/tokens (recorded tokens)."""
    rec = np.asarray(recorded)
    have = np.all(rec >= 0, axis=-1) & np.asarray(real, bool)[..., None]  # [R, L, n]
    differs = np.any(np.sort(np.asarray(experts), -1) != np.sort(rec, -1), axis=-1) & have
    tokens = have.any(-1)
    out = {"routing/tokens": float(tokens.sum())}
    if tokens.any():
        out["routing/mismatch"] = float(differs.any(-1).sum() / tokens.sum())
        out["routing/layer_mismatch"] = float(differs.sum() / have.sum())
    return out


def check_routing(alarms: Alarms, m: dict[str, Any], where: str) -> None:
    """Fires the routing alarm when the step's mismatch fraction passes its threshold."""
    cfg = alarms.config.routing
    value = m.get("routing/mismatch")
    if not alarms.config.on("routing") or value is None or value <= cfg.threshold:
        return
    alarms.fire(
        "routing",
        f"MoE routing mismatch: the learner routes {value:.1%} of "
        f"{int(m['routing/tokens'])} tokens to other experts than the sampler recorded "
        f"(per layer {m['routing/layer_mismatch']:.1%}; threshold {cfg.threshold:.1%})",
        where,
    )


class WeightsCheck:
    """weights served = weights published. `published(version, checksum, now)` after
    each publish; `served(report, now)` with the sampler's `served_weights()`
    ({"version", "checksum"} or None when it cannot say)."""

    def __init__(self, alarms: Alarms):
        self.alarms = alarms
        self.checksums: dict[int, str | None] = {}
        self.latest: tuple[int, float] | None = None  # (version, when published)
        self.unverified = 0
        self.verified = 0
        self.mismatches = 0

    def published(self, version: int, checksum: str | None, now: float) -> None:
        self.checksums[int(version)] = checksum
        self.latest = (int(version), now)

    def served(self, report: dict | None, now: float, where: str) -> None:
        """Checks a sampler's report: {"version", "checksum", "running_version"?} or,
        for a fleet, {"members": [report, ...]} (each member checked)."""
        if not self.alarms.config.on("weights"):
            return
        if report and report.get("members") is not None:
            for i, member in enumerate(report["members"]):
                self.served(member, now, f"{where}, backend {i}")
            return
        cfg = self.alarms.config.weights
        if not report or report.get("version") is None:
            self.unverified += 1
            return
        version, checksum = int(report["version"]), report.get("checksum")
        running = report.get("running_version")
        running = version if running is None else min(version, int(running))
        want = self.checksums.get(version)
        if checksum is None or want is None:
            self.unverified += 1
        elif checksum != want:
            self.mismatches += 1
            if self.mismatches > cfg.threshold:
                self.alarms.fire(
                    "weights",
                    f"the sampler serves version {version} with checksum {checksum}, the "
                    f"learner published {want}: it serves other weights than published "
                    "(a skipped or partial load)",
                    where,
                )
        else:
            self.verified += 1
        if self.latest is not None and running < self.latest[0]:
            late = now - self.latest[1]
            if late > cfg.deadline_s:
                self.alarms.fire(
                    "weights",
                    f"the sampler still serves version {running}, {late:.0f}s after version "
                    f"{self.latest[0]} was published (deadline {cfg.deadline_s:g}s)",
                    where,
                )

    def metrics(self) -> dict[str, float]:
        return {
            "alarms/weights_verified": float(self.verified),
            "alarms/weights_unverified": float(self.unverified),
            "alarms/weights_mismatches": float(self.mismatches),
        }
