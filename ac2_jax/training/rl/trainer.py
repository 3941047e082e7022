"""Task-level RL: rollouts through the endpoint -> rewards -> one update -> publish.

    tasks (domain mix) -> G attempts each through orchestrators over the
    endpoint, concurrently -> verifier rewards -> group advantages ->
    segments -> packed batch -> PPO-clip loss, task_mean -> update ->
    publish weights (Orbax) -> the sampler reloads.

With `BatchConfig.rows` at the most a step needs and `RLConfig.grad_accum`
(empty micro-batches are skipped), the train step compiles once; with
`RLConfig.compile_ahead` that compile runs in a thread while the first step's
rollouts are collected (`warmup_step`).

mode="sync" collects step s with the weights of update s. mode="async"
collects step s+1 while step s trains, so sampling and training overlap;
traces lagging more than `max_staleness` versions are dropped or
down-weighted and truncated importance weights correct the rest. Every
collected rollout is appended to `workdir/rollouts.jsonl` as it finishes, and
the shared `Trainer` checkpoints after every step (`workdir/checkpoints/<steps
done>`) and logs train/ metrics (`workdir/metrics`), so a killed run resumes
at the next step without repeating or losing rollouts. Rollouts that end
infra_error (our fault) are retried, counted in the step metrics, and never
trained.

Dynamic sampling (`RLConfig.dynamic_sampling`): groups whose traces all
train with one reward carry no advantage; they are left out of the batch and
the step is refilled with new tasks (`EndpointCollector.refill`), up to
`max_refills` rounds, until it has `tasks_per_step` informative groups. An
adaptive `DomainMixer` env (`AdaptiveMix`) is fed each step's traces before
the next step's tasks are drawn (and, on resume, the stored traces of the
steps done), and its weights are logged with the step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ac2_jax.envs.mixer import DomainMixer
from ac2_jax.models.lora import has_lora
from ac2_jax.sampling.engine.batching import occupancy_metrics
from ac2_jax.trace.types import Trace
from ac2_jax.training.core.checkpoints import publish
from ac2_jax.training.core.metrics_log import MetricsLogger
from ac2_jax.training.core.objectives import DRIFT_ONPOLICY, Objective, PolicyGradientLoss
from ac2_jax.training.core.state import OptimizerConfig, create_train_state
from ac2_jax.training.core.train_step import TrainStep, make_train_step
from ac2_jax.training.core.trainer import Trainer, TrainerHooks
from ac2_jax.training.core.watchdog import Watchdog
from ac2_jax.training.rl.alarms import (
    Alarms,
    AlarmsConfig,
    WeightsCheck,
    check_drift,
    check_routing,
    drift_metrics,
    routing_mismatch,
)
from ac2_jax.training.rl.batching import batch_segments, pack_rl_batch, warmup_batch

# The collectors live in collectors.py; importable from here as before.
from ac2_jax.training.rl.collectors import (  # noqa: F401
    Collector,
    EndpointCollector,
    ReplayCollector,
    refill_seed,
)
from ac2_jax.training.rl.data import (
    BatchConfig,
    MoEConfig,
    group_name,
    informative_groups,
    select_traces,
    trace_rewards,
)
from ac2_jax.training.rl.features import carries_signal
from ac2_jax.training.rl.metrics import batch_metrics, staleness_histogram, trace_agent_metrics

RL_MODES = ("sync", "async")
# What decides step s's tasks and attempts: a checkpoint of another stream must not be resumed.
_DATA_KEYS = ("seed", "tasks_per_step", "attempts_per_task")


@dataclasses.dataclass(frozen=True)
class RLConfig:
    steps: int = 10
    tasks_per_step: int = 8
    attempts_per_task: int = 8
    mode: str = "sync"
    seed: int = 0
    concurrency: int = 64
    batch: BatchConfig = BatchConfig()
    # Mixture-of-experts policies: routing replay or not (`MoEConfig`).
    moe: MoEConfig = MoEConfig()
    # The step runs each batch as grad_accum micro-batches of batch.rows / grad_accum
    # rows and skips those without a loss token: batch.rows can be the most a step
    # needs (one compiled geometry) while a step with less data computes only its rows.
    grad_accum: int = 1
    # Compile the train step in a thread while the first rollouts are collected
    # (`RLTrainer.warmup_step`). For a pinned geometry only: with the default capacities
    # (one segment per trace) multi-episode traces pack to more segments, another
    # geometry, and the compile goes unused (warned). A win where the sampler runs on
    # an accelerator and the compile on idle host cores; on 2 CPU cores about even.
    compile_ahead: bool = False
    # Any registered `Objective` (configs: `rl.loss.kind`, default "ppo").
    loss: Objective = PolicyGradientLoss()
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-4)
    keep_checkpoints: int = 2
    # Loop steps between checkpoints: 1 checkpoints after every step; k > 1 after every
    # k-th step and the last. A run killed between two checkpoints resumes at the last one
    # and redoes the later steps from the stored rollouts (the collector replays them:
    # nothing is sampled again or lost). With the in-memory hand-off (`RLTrainer(hand_off=)`,
    # no `on_publish`) the publish folder is written on the same steps: the sampler has
    # every update in memory, and each write (Orbax, like the checkpoint) runs beside the
    # next step's rollout and update (their cost on 2 cores:
    # docs/notes/2026-12-07-in-memory-weight-hand-off.md).
    checkpoint_every: int = 1
    # Leave out zero-advantage groups and refill the step with new tasks, up to
    # max_refills rounds (module docstring); needs a collector with `refill`.
    dynamic_sampling: bool = False
    max_refills: int = 2

    def __post_init__(self):
        if self.mode not in RL_MODES:
            raise ValueError(f"RLConfig.mode must be one of {RL_MODES}, got {self.mode!r}")
        if self.max_refills < 0:
            raise ValueError(f"RLConfig.max_refills must be >= 0, got {self.max_refills}")
        for name in (
            "steps",
            "tasks_per_step",
            "attempts_per_task",
            "concurrency",
            "grad_accum",
            "checkpoint_every",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"RLConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.batch.rows % self.grad_accum:
            raise ValueError(
                f"RLConfig: batch.rows={self.batch.rows} must split into "
                f"grad_accum={self.grad_accum} micro-batches: make rows a "
                "multiple of grad_accum"
            )
        if getattr(self.loss, "needs_whole_attempts", False) and self.grad_accum > 1:
            raise ValueError(
                f"RLConfig: loss kind {type(self.loss).__name__} takes one ratio per attempt "
                f"over all its tokens, which grad_accum={self.grad_accum} micro-batches would "
                "split; use grad_accum=1 (more batch.rows per step) or another loss kind"
            )
        if self.batch.mean_over == "problem" and self.loss.mode not in ("task_mean", "task_sum"):
            raise ValueError(
                f"RLConfig: batch.mean_over='problem' reweights the attempts of the "
                f"task_mean (or task_sum) loss; loss.mode={self.loss.mode!r} would not average "
                "over problems: use loss.mode='task_mean' or batch.mean_over='attempt'"
            )
        if self.mode == "async" and self.batch.max_staleness < 1 and self.batch.stale == "drop":
            # Async collects step s+1 with the weights of update s - 1: every trace lags
            # one version, so max_staleness=0 with stale="drop" drops every batch.
            raise ValueError(
                "RLConfig: mode='async' needs batch.max_staleness >= 1 (its traces "
                "lag one version) or batch.stale='downweight'; with "
                f"max_staleness={self.batch.max_staleness} and stale='drop' "
                "every step would be dropped"
            )


def launch_reference(model, params):
    """The reference policy of a KL term (`PolicyGradientLoss.kl_coef`), as the train
    step's teacher params (same structure as `params`, the state's trained params):

    - LoRA (`models.lora.has_lora(model)`): the adapters zeroed. The base weights
      live in the state's `rest`, which the reference shares, and a zero adapter adds
      0: the base with the adapters off, no second copy of the weights.
    - Otherwise: a copy of `params` as launched (one more params-sized array set on
      the device; the copy, so the step's donation never frees it).
    """
    if has_lora(model):
        return jax.tree.map(jnp.zeros_like, params)
    return jax.tree.map(jnp.array, params)


class _RefillCollector(Collector, Protocol):
    """A collector dynamic sampling can refill (`RLConfig.dynamic_sampling`)."""

    async def refill(self, rl_step: int, round: int, n: int) -> tuple[list[Trace], int]: ...


def _json_like(tree: Any) -> Any:
    """`tree` as it reads back from a JSON checkpoint (tuples -> lists, str keys)."""
    return json.loads(json.dumps(tree))


class RLTrainer(TrainerHooks):
    """The RL loop around a model. `on_publish(version)` makes the sampler reload.

    Its own `TrainerHooks` (as SelfDistiller is): the checkpoint holds, besides the
    train state and the loop step (= the next rl_step; the data position), what
    decides the task stream (seed, tasks_per_step, attempts_per_task: a resume
    with others is a ValueError) and the adaptive mixer's recorded results (the
    mixer is rebuilt by replaying the stored traces of the steps done; a replay
    that differs from the checkpoint's is warned). The rollouts themselves live in
    the collector's store (`rollouts.jsonl`, crash-safe, not checkpoint state).

    `on_progress(steps_done, version)` (a function or coroutine function) runs
    when `run` starts and after each loop step's checkpoint began: a learner in
    its own process tells the endpoint which step to serve and how far it is
    (`training.rl.split`: the collector paces itself on that).

    A collector that says how it collects (`tasks_per_step`, `attempts`,
    `concurrency` attributes, as EndpointCollector does) must agree with
    `config` (tasks_per_step, attempts_per_task, concurrency): a mismatch is a
    ValueError, never silently one or the other. `dynamic_sampling` needs a
    collector with `refill`. When the collector's `env` is an adaptive
    DomainMixer, each step's traces update it and the step metrics carry its
    `mix_weight/<domain>` (the shares the next step draws with),
    `mix_pass_rate/<domain>` and `mix_results/<domain>`. The loop is a `Trainer`
    (`self.trainer`); logger replaces its `workdir/metrics` sink;
    make_step: e.g. a `StepCache` shared by several trainers.
    `sampler_counters` (e.g. `JaxSampler.counters`): each step's metrics then
    carry `sampler/...`, what the sampler did since the previous step's
    traces came in (`sampling.occupancy_metrics`: mean active rows and
    occupancy, decode / prefill seconds, new compiles). `publish_dir`: where
    each update's weights are published for the sampler (default
    `workdir/published`; the sampler must be built with the same folder).
    `tokenizer`: the sampler's, needed when traces hold grammar-constrained
    completions (tool_choice="required"): their masks are replayed with it
    (over the model's vocabulary) so the loss re-scores those tokens as they
    were sampled; without it such a trace is an error.

    `hand_off(params, version)` (e.g. `JaxSampler.set_params`, what the RL recipe
    passes for its embedded sampler: `SamplerConfig.hand_off`): the in-memory
    hand-off to a sampler in this process. Each publish then gives it the learner's
    params directly (`params_io.published_params` of the train state: every Param,
    or a LoRA model's adapters alone; on the learner's devices, which the sampler
    copies and casts) instead of its reloading them from `publish_dir`; the version,
    the weights alarm's checksum (`weights_checksum` of the same params, what the
    publish's checksum file holds) and the sampler's swap rule are those of the
    disk route. `publish_dir` is still written, off the critical path: a copy of the
    params goes to a background thread that publishes it once the step's checkpoint
    save has begun and committed (Orbax saves never overlap in one process), joined
    before the next publish or checkpoint save, at the end of `run` and in `close`
    (its error is raised there); `on_publish(version)`, when given, runs in that
    thread once the step is on disk (e.g. a second sampler that reads the folder):
    the hook for readers of the folder, since `on_progress` may run before the step's
    write finished. The copy costs one more copy of the published params on the
    learner's devices until it is written.
    Single-process learners only (ValueError otherwise).

    `alarms` (default `AlarmsConfig()`: on): the correctness alarms of
    `training.rl.alarms`. Each update measures sampler/learner drift
    (single-process learners; from the loss's own forward for every
    `PolicyGradientLoss` kind, one more forward for other objectives), each publish's
    checksum is compared with `served_weights()` (the sampler's report, e.g.
    `JaxSampler.served_weights`; a function or coroutine function) after the
    publish and after each step, and a `Watchdog` watches the collection, train
    step and publish stages. The step metrics carry every alarm's metric
    (`drift/...`, `alarms/...`); a "stop" alarm raises `AlarmStop` out of `run`.
    """

    def __init__(
        self,
        model,
        collector: Collector,
        config: RLConfig,
        workdir: str,
        *,
        on_publish: Callable[[int], Any] | None = None,
        on_progress: Callable[[int, int], Any] | None = None,
        mesh=None,
        logger: MetricsLogger | None = None,
        make_step: Callable[..., TrainStep] = make_train_step,
        progress: bool = False,
        sampler_counters: Callable[[], dict] | None = None,
        publish_dir: str | os.PathLike | None = None,
        tokenizer: Any = None,
        alarms: AlarmsConfig | None = None,
        served_weights: Callable[[], Any] | None = None,
        hand_off: Callable[[dict, int], Any] | None = None,
    ):
        if hand_off is not None and jax.process_count() > 1:
            raise ValueError(
                f"RLTrainer: hand_off (the in-memory weight hand-off) needs a single-process "
                f"learner, this is one of {jax.process_count()} processes; publish through "
                "publish_dir (hand_off=None; the RL recipe: sampler.hand_off=disk)"
            )
        for ours, theirs in (
            ("tasks_per_step", "tasks_per_step"),
            ("attempts_per_task", "attempts"),
            ("concurrency", "concurrency"),
        ):
            have = getattr(collector, theirs, None)
            if have is not None and have != getattr(config, ours):
                raise ValueError(
                    f"RLTrainer: RLConfig.{ours}={getattr(config, ours)} but the "
                    f"collector's {theirs} is {have}; configure both alike"
                )
        if config.dynamic_sampling and not callable(getattr(collector, "refill", None)):
            raise ValueError(
                f"RLTrainer: RLConfig.dynamic_sampling needs a collector with "
                f"refill(rl_step, round, n) (e.g. EndpointCollector); "
                f"{type(collector).__name__} has none"
            )
        self.config, self.collector, self.on_publish = config, collector, on_publish
        self.on_progress, self.sampler_counters = on_progress, sampler_counters
        self.tokenizer = tokenizer
        self.alarms = Alarms(alarms)
        self.served_weights = served_weights
        self.hand_off = hand_off
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._writing: concurrent.futures.Future | None = None  # the background publish
        self._to_write: Callable[[], None] | None = None  # ... not started yet
        self._written: int | None = None  # the version last written (or to be) to the folder
        self._weights = WeightsCheck(self.alarms)
        self._backoff_seen = 0.0
        self._route_fn: Callable | None = None  # jitted learner routing (routing alarm)
        # The traces of the last step, refills included (on_progress reads their errors).
        self.last_traces: list[Trace] = []
        self._vocab_size = getattr(getattr(model, "config", None), "vocab_size", None)
        traces = config.tasks_per_step * config.attempts_per_task
        self._batch_config = dataclasses.replace(
            config.batch,
            task_capacity=config.batch.task_capacity or traces,
            segment_capacity=config.batch.segment_capacity or traces,
            drop_zero_advantage=config.batch.drop_zero_advantage or config.dynamic_sampling,
        )
        self.workdir = os.path.abspath(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        self.publish_dir = (
            os.path.abspath(publish_dir)
            if publish_dir is not None
            else os.path.join(self.workdir, "published")
        )
        if jax.process_count() > 1:
            if mesh is None:
                raise ValueError(
                    f"RLTrainer: this is process {jax.process_index()} of "
                    f"{jax.process_count()} (jax.distributed) but mesh=None; pass a mesh over "
                    "every process's devices, e.g. make_mesh(data=jax.device_count())"
                )
            if config.batch.layout != "flat":  # fail now, not after the first collection
                raise ValueError(
                    f"RLTrainer: a learner over {jax.process_count()} processes packs shares "
                    f"of each batch, which needs RLConfig.batch.layout='flat', got "
                    f"{config.batch.layout!r} (experiments: --config.rl.batch.layout=flat)"
                )
            if logger is None and jax.process_index() > 0:
                # Every process logs its (identical) metrics, each to its own file.
                logger = MetricsLogger(
                    os.path.join(self.workdir, "metrics", f"process{jax.process_index()}"),
                    tensorboard=False,
                    console=False,
                )
        self.graphdef, state = create_train_state(model, config.optimizer, rng=config.seed)
        # The KL's reference policy (rl.loss.kl_coef > 0): the launch weights, taken before
        # a checkpoint is restored (`launch_reference`); None when no loss term reads it.
        self.reference = (
            launch_reference(model, state.params)
            if getattr(config.loss, "needs_reference", False)
            else None
        )
        env = getattr(collector, "env", None)
        self.mixer = env if isinstance(env, DomainMixer) and env.adaptive is not None else None
        self._checkpoint_mixer: dict | None = None  # the restored checkpoint's mixer state
        self.trainer = Trainer(
            self.graphdef,
            state,
            config.loss,
            config.optimizer,
            workdir=self.workdir,
            checkpoint_every=config.checkpoint_every,
            keep_checkpoints=config.keep_checkpoints,
            mesh=mesh,
            grad_accum=config.grad_accum,
            make_step=make_step,
            logger=logger,
            progress=progress,
            total_steps=config.steps,
            hooks=self,
        )
        try:
            self.start_step = self.trainer.restore()  # = loop steps done = the next rl_step
        except BaseException:
            self.trainer.close()  # e.g. a checkpoint of another task stream (ValueError)
            raise
        self._published: int | None = None
        self.history: list[dict[str, Any]] = []
        if self.mixer is not None and self.start_step > 0:
            self._replay_mixer()

    # -- checkpoints (TrainerHooks)

    def state_dict(self) -> dict:
        out: dict[str, Any] = {k: getattr(self.config, k) for k in _DATA_KEYS}
        out["mixer"] = None if self.mixer is None else self.mixer.state()
        return out  # the data position itself is the trainer's steps_done

    def load_state_dict(self, data: dict) -> None:
        # Checkpoints written before these keys were saved hold none of them.
        bad = {
            k: (data[k], getattr(self.config, k))
            for k in _DATA_KEYS
            if k in data and data[k] != getattr(self.config, k)
        }
        if bad:
            raise ValueError(
                "RLTrainer: the checkpoint's task stream differs from this run: "
                + ", ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in bad.items())
            )
        self._checkpoint_mixer = data.get("mixer")

    def _replay_mixer(self) -> None:
        """Feeds the mixer the stored traces of the steps done, as the killed run did."""
        assert self.mixer is not None  # only called with an adaptive mixer
        stored = getattr(self.collector, "stored", None)
        if stored is None:
            logging.warning(
                "RLTrainer: resuming at rl_step %d with an adaptive DomainMixer but "
                "the collector keeps no stored traces; the mixer starts empty",
                self.start_step,
            )
            return
        for s in range(self.start_step):
            recorded = self.mixer.update(stored(s))
            if not recorded:
                logging.warning(
                    "RLTrainer: no stored results of rl_step %d for the adaptive "
                    "DomainMixer; its weights differ from the run that trained it",
                    s,
                )
        want = self._checkpoint_mixer
        if want is not None and _json_like(self.mixer.state()) != want:
            logging.warning(
                "RLTrainer: the adaptive DomainMixer replayed from the stored traces of "
                "rl_steps 0..%d differs from the checkpoint's (the store changed since?); "
                "its weights differ from the run that trained it",
                self.start_step - 1,
            )

    @property
    def step_fn(self) -> TrainStep:
        return self.trainer.step_fn

    @property
    def state(self):
        return self.trainer.state

    @property
    def version(self) -> int:
        """Policy version of the learner = number of updates done."""
        return int(jax.device_get(self.trainer.host_state().step))

    def model(self):
        return self.trainer.model()

    def update(self, traces: Sequence[Trace]) -> dict[str, Any]:
        """One update from traces (the same in sync and async mode)."""
        version = self.version
        # Every process selects and segments the same traces alike (host-side,
        # deterministic); each packs only its share (the step makes one global batch).
        sources: list[tuple[str, bool]] = []  # per segment: (its completion, on-policy)
        # The routing alarm reads the recorded routing with replay off too (flat rows);
        # the train step then gets none (`rl.moe.routing="recompute"`).
        recompute = self.config.moe.routing == "recompute"
        watch_routing = (
            recompute
            and self.alarms.config.on("routing")
            and self._batch_config.layout == "flat"
            and jax.process_count() == 1
        )
        segments, stats, adv = batch_segments(
            traces,
            version,
            self._batch_config,
            tokenizer=self.tokenizer,
            vocab_size=self._vocab_size,
            moe_routing="replay" if watch_routing else self.config.moe.routing,
            sources=sources,
        )
        if watch_routing:
            stats.replayed_routing_tokens = 0  # read by the alarm, not replayed
        # Rewards of the traces with a verdict (infra_error ones have none).
        rewards = trace_rewards([t for t in traces if t.status != "infra_error"])
        m: dict[str, Any] = {
            "reward_mean": float(rewards.mean()) if len(rewards) else 0.0,
            "pass_rate": float((rewards >= 1.0).mean()) if len(rewards) else 0.0,
            "adv_mean": float(adv.mean()) if len(adv) else 0.0,
            "adv_std": float(adv.std()) if len(adv) else 0.0,
            "adv_abs_mean": float(np.abs(adv).mean()) if len(adv) else 0.0,
            # Per agent (rl/metrics.py): agent_tokens/<group> generated, trained_tokens/<group>
            # in the batch, episodes, compactions, memo fidelity, staleness_hist/<lag>.
            **trace_agent_metrics(traces),
            **batch_metrics(stats),
            **staleness_histogram(traces, version, self._batch_config.train_agents),
            "infra_retries": float(sum(t.metadata.get("infra_retries", 0) for t in traces)),
        }
        # Decided on the whole batch's segments (every one has agent tokens), so every
        # process of a multi-host learner skips or steps together.
        if not any(carries_signal(seg) for seg in segments):
            m["skipped_update"] = 1.0  # nothing to learn from (e.g. all rewards equal)
            return m
        batch = pack_rl_batch(
            segments,
            stats.row_len,
            self._batch_config,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        if batch.routing is not None and self.alarms.config.on("routing"):
            if jax.process_count() == 1:
                m.update(self._routing(batch))
                check_routing(self.alarms, m, f"update of version {version}")
            if recompute:
                batch = dataclasses.replace(batch, routing=None)
        drift = self.alarms.config.on("drift") and jax.process_count() == 1
        extras = None
        if drift and self._drift_in_step:  # from the step's own forward (no other)
            extras = {DRIFT_ONPOLICY: self._onpolicy(batch, sources, version)}
        elif drift:  # a loss without the drift sums: one more forward, before the update
            m.update(self._drift(batch, sources, version))
        m.update(self.trainer.update(batch, extras, teacher=self.reference))
        if extras is not None:
            m.update(self._drift_from_step(m, batch, extras[DRIFT_ONPOLICY], sources, version))
        m["skipped_update"] = 0.0
        return m

    @property
    def _drift_in_step(self) -> bool:
        # Every PolicyGradientLoss kind computes the drift sums in its forward.
        return isinstance(self.config.loss, PolicyGradientLoss)

    @staticmethod
    def _onpolicy(batch, sources: list[tuple[str, bool]], version: int) -> np.ndarray:
        """[R, L] float32: 1 where the token was sampled by `version` (per token by
        the batch's POLICY_VERSION; else per segment by `sources`)."""
        from ac2_jax.segments import POLICY_VERSION

        per_token = batch.features.get(POLICY_VERSION)
        if per_token is not None:
            return (np.asarray(per_token) == version).astype(np.float32)
        on = np.asarray([o for _, o in sources], bool)
        seg = np.asarray(batch.segment_index)
        if not on.size:
            return np.zeros(seg.shape, np.float32)
        return on[np.clip(seg, 0, on.size - 1)].astype(np.float32)

    def _drift_from_step(self, m, batch, onpolicy, sources, version) -> dict[str, float]:
        """The drift metrics (`alarms.drift_metrics`' keys but the max) from the
        step's sums (`objectives.drift_sums`, popped from `m`): the learner's log-probs
        are the loss's, at the weights before the update, so the alarm costs no
        forward. A fired alarm names the worst completions from one more forward, at
        the updated weights (said in the line): only when it fires."""
        mask = np.asarray(batch.loss_mask)
        denom = max(float(mask.sum()), 1e-8)  # what the step divided every sum by
        trained = mask > 0
        out: dict[str, float] = {}
        for kind, sel in (("onpolicy", onpolicy > 0), ("stale", onpolicy <= 0)):
            n = int((trained & sel).sum())
            abs_sum, kl_sum = m.pop(f"_drift_{kind}_abs"), m.pop(f"_drift_{kind}_kl")
            out[f"drift/{kind}_tokens"] = float(n)
            if n:
                out[f"drift/{kind}_abs_mean"] = abs_sum * denom / n
                out[f"drift/{kind}_kl"] = kl_sum * denom / n
        cfg = self.alarms.config.drift
        value = out.get("drift/onpolicy_abs_mean")
        if value is not None and value > cfg.threshold:
            from ac2_jax.segments import SAMPLER_LOGPROBS

            _, worst = drift_metrics(
                np.asarray(jax.device_get(self.step_fn.logprobs(self.trainer.state, batch))),
                np.asarray(batch.feature(SAMPLER_LOGPROBS)),
                mask,
                np.asarray(batch.segment_index),
                [on for _, on in sources],
                [name for name, _ in sources],
                worst=self.alarms.config.worst,
                token_on_policy=onpolicy > 0,
            )
            check_drift(self.alarms, out, worst, f"update of version {version}",
                        ranked_by="the updated learner")  # fmt: skip
        return out

    def _routing(self, batch) -> dict[str, float]:
        """The routing alarm's metrics (`alarms.routing_mismatch`): the learner's own
        top k per token (a forward without replay) against the batch's recorded routing."""
        if self._route_fn is None:
            graphdef = self.graphdef

            def experts(params, rest, tokens, positions, segment_ids, subtree_end):
                module = nnx.merge(graphdef, params, rest)
                return module.forward_with_router(tokens, positions, segment_ids, subtree_end)[
                    1
                ].experts

            self._route_fn = jax.jit(experts)
        state = self.trainer.state
        got = self._route_fn(
            state.params, state.rest, batch.tokens, batch.positions, batch.segment_ids,
            batch.subtree_end,
        )  # fmt: skip
        return routing_mismatch(
            np.asarray(jax.device_get(got)), np.asarray(batch.routing), batch.segment_ids > 0
        )

    def _drift(self, batch, sources: list[tuple[str, bool]], version: int) -> dict[str, float]:
        """Sampler/learner drift of the batch at the weights about to train on it
        (`alarms.drift_metrics`); fires the drift alarm past its threshold."""
        from ac2_jax.segments import POLICY_VERSION, SAMPLER_LOGPROBS

        learner = np.asarray(jax.device_get(self.step_fn.logprobs(self.trainer.state, batch)))
        per_token = batch.features.get(POLICY_VERSION)  # per-token versions (in-flight swaps)
        out, worst = drift_metrics(
            learner,
            np.asarray(batch.feature(SAMPLER_LOGPROBS)),
            np.asarray(batch.loss_mask),
            np.asarray(batch.segment_index),
            [on for _, on in sources],
            [name for name, _ in sources],
            worst=self.alarms.config.worst,
            token_on_policy=None if per_token is None else np.asarray(per_token) == version,
        )
        check_drift(self.alarms, out, worst, f"update of version {version}")
        return out

    def warmup_step(self) -> bool:
        """Compiles the train step for the configured geometry ([rows, seq_len] rows,
        the task and segment capacities, the layout) from a one-token batch packed
        like a real one, without running it; `run` does this in a thread while
        the first step's rollouts are collected. False where the step is not
        compiled ahead (`Trainer.warmup`) or the compile failed (logged: the first
        update then compiles, and fails loudly if the step is broken)."""
        try:
            batch = warmup_batch(
                self._batch_config,
                process_index=jax.process_index(),
                process_count=jax.process_count(),
            )
            extras = None  # as `update` will pass them, or the warm compile goes unused
            if self.alarms.config.on("drift") and self._drift_in_step:
                extras = {DRIFT_ONPOLICY: np.zeros(batch.tokens.shape, np.float32)}
            return self.trainer.warmup(batch, extras, teacher=self.reference)
        except Exception:  # noqa: BLE001 - an optimisation; the update compiles anyway
            logging.exception(
                "RLTrainer: compiling the train step ahead failed; the first update compiles it"
            )
            return False

    async def _refill(self, rl_step: int, traces: list[Trace]) -> tuple[list[Trace], dict]:
        """Dynamic sampling: refills the step until it has `tasks_per_step` informative
        groups or `max_refills` rounds ran; returns (all traces, refill metrics)."""
        cfg, version = self.config, self.version

        def informative(ts):
            return len(informative_groups(select_traces(ts, version, self._batch_config)[0]))

        # __init__ refused dynamic sampling for a collector without refill.
        refiller = cast(_RefillCollector, self.collector)
        m = {"refills": 0.0, "refill_tasks": 0.0, "refill_repeats": 0.0}
        have = informative(traces)
        while have < cfg.tasks_per_step and m["refills"] < cfg.max_refills:
            m["refills"] += 1
            more, repeated = await refiller.refill(
                rl_step, int(m["refills"]), cfg.tasks_per_step - have
            )
            traces = traces + more
            m["refill_tasks"] += len({group_name(t) for t in more})
            m["refill_repeats"] += repeated
            have = informative(traces)
        m["informative_groups"] = float(have)
        if have < cfg.tasks_per_step:
            logging.warning(
                "rl_step %d: %d informative groups of %d wanted after %d refills",
                rl_step,
                have,
                cfg.tasks_per_step,
                cfg.max_refills,
            )
        return traces, m

    def publish(self) -> int:
        """Writes the learner's weights for the sampler and tells it to reload (with
        `hand_off`: hands them over in memory; their write to `publish_dir` starts in
        the background once the step's checkpoint save began, and `wait_published`
        starts it if it has not and waits for it: a caller of `publish` that reads the
        folder calls that first). In `run`, a hand-off without `on_publish` writes the
        folder only on the steps that checkpoint (`RLConfig.checkpoint_every`)."""
        return self._publish(write=True)

    def _publish(self, write: bool) -> int:
        """`publish`; write=False: a hand-off without `on_publish` skips the folder."""
        if self.hand_off is not None:
            return self._hand_off(write or self.on_publish is not None)
        if jax.process_count() > 1:
            # Orbax's managers share their barrier names across processes: a publish
            # while the last checkpoint still finalizes in its thread enters the same
            # barrier twice ("already ongoing"); on one process nothing waits.
            self.trainer.wait()
        version = self._published = self.version
        publish(self.graphdef, self.trainer.host_state(), self.publish_dir, version)
        if self.alarms.config.on("weights"):
            from ac2_jax.models.io.params_io import published_checksum

            checksum = published_checksum(self.publish_dir, version)
            self._weights.published(version, checksum, time.monotonic())
        if self.on_publish is not None:
            self.on_publish(version)
        return version

    def _hand_off(self, write: bool = True) -> int:
        from ac2_jax.models.io.params_io import published_params, weights_checksum

        assert self.hand_off is not None
        self.wait_published()  # the previous write first: one at a time, in order
        version = self._published = self.version
        model = self.trainer.host_state().model(self.graphdef)
        params = published_params(model)
        if self.alarms.config.on("weights"):
            self._weights.published(version, weights_checksum(params), time.monotonic())
        self.hand_off(params, version)
        if write:  # else the folder keeps the last checkpointed step's (`_publish`)
            self._write_later(model, params, version)
        return version

    def _write_later(self, model, params, version: int) -> None:
        """Prepares the hand-off's write of `params` (`version`) to the folder; it starts
        in the background with `_write_behind`."""
        from ac2_jax.models.io.params_io import publish_params, published_lora

        # The disk publish from a copy (the next update donates the state's arrays).
        copy = jax.tree.map(jnp.copy, params)
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(1, "rl-publish")
        lora, on_publish = published_lora(model), self.on_publish
        self._written = version

        def write() -> None:
            # Orbax saves must not overlap in one process (its step-directory signals
            # time out: the loop race's first try), so the write starts after the
            # step's checkpoint save began (`_write_behind`), waits for its commit, and
            # is joined before the next save (by the next publish, or before the next
            # step's checkpoint when that step publishes nothing).
            self.trainer.wait()
            publish_params(copy, self.publish_dir, version, 3, lora)
            if on_publish is not None:  # a reader of the folder: after the write
                on_publish(version)

        self._to_write = write

    def _write_folder(self) -> None:
        """On a checkpoint step that published nothing: the folder gets the served
        version (the state's weights: no update since) if a step skipped its write."""
        from ac2_jax.models.io.params_io import published_params

        if self.hand_off is None or self._published is None or self._written == self._published:
            return
        self.wait_published()
        model = self.trainer.host_state().model(self.graphdef)
        self._write_later(model, published_params(model), self._published)

    def _write_behind(self) -> None:
        """Starts the pending background publish (`hand_off`), if any."""
        write, self._to_write = self._to_write, None
        if write is not None:
            assert self._writer is not None and self._writing is None
            self._writing = self._writer.submit(write)

    def wait_published(self) -> None:
        """Writes the in-memory hand-off's publish (`hand_off`) or waits for its
        background write; raises its error. A no-op without one."""
        self._write_behind()
        self._join_write()

    def _join_write(self) -> None:
        """Waits for the running background write (a pending one is not started);
        raises its error (once: the write is forgotten when it is done)."""
        writing = self._writing
        if writing is None:
            return
        try:
            writing.result()
        except BaseException as e:
            if writing.done() and e is writing.exception():  # its error, raised here
                self._writing = None
            raise  # else interrupted (Ctrl-C): the write is left to `close`
        self._writing = None

    async def _await_write(self) -> None:
        """`_join_write` on the event loop, and the loop's only join: a cancelled wait
        (Ctrl-C) leaves the running write to `close`, which joins it and raises its
        error (a join in a worker thread would raise it to nobody)."""
        writing = self._writing
        if writing is None:
            return
        waited = asyncio.wrap_future(writing)
        # Its error stays in `writing` (raised by `close`); not logged as never retrieved.
        waited.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await asyncio.shield(waited)
        except asyncio.CancelledError:
            raise  # the write is left to `close`
        except BaseException:
            self._writing = None  # its error, raised here
            raise
        self._writing = None

    async def check_served(self, where: str) -> None:
        """The weights alarm: compares `served_weights()` with what was published."""
        if self.served_weights is None or not self.alarms.config.on("weights"):
            return
        # In a thread: the sampler may compute its checksum now (a reduction over the weights).
        report = await asyncio.to_thread(self.served_weights)
        if inspect.isawaitable(report):  # e.g. split.endpoint_weights: asks over HTTP
            report = await report
        self._weights.served(report, time.monotonic(), where)

    def alarm_metrics(self) -> dict[str, float]:
        """Every alarm's counters so far (`alarms/...`)."""
        out = self.alarms.metrics()
        if self.alarms.config.on("weights"):
            out.update(self._weights.metrics())
        return out

    async def _progress(self) -> None:
        if self.on_progress is not None:
            out = self.on_progress(self.trainer.steps_done, self.version)
            if inspect.isawaitable(out):
                await out

    async def run(self) -> list[dict[str, Any]]:
        hang = self.alarms.config.hang
        dog = (
            Watchdog(hang.threshold, hang.action, where="learner")
            if self.alarms.config.on("hang")
            else None
        )
        try:
            return await self._run(dog)
        finally:
            if dog is not None:
                dog.close()

    async def _run(self, dog: Watchdog | None) -> list[dict[str, Any]]:
        def stage(name: str):
            return contextlib.nullcontext() if dog is None else dog.stage(name)

        cfg = self.config
        if self.start_step >= cfg.steps:
            # Nothing left to train, but the sampler must serve the trained
            # weights (a rerun would otherwise evaluate whatever it had loaded).
            await asyncio.to_thread(self.publish)
            self._write_behind()
            await self._await_write()
            await self._progress()
            return self.history
        if self.start_step > 0:
            with stage("publish"):
                await asyncio.to_thread(self.publish)  # the sampler serves the restored weights
            self._write_behind()  # no checkpoint save is under way now
            await self.check_served(f"after publishing version {self._published}")
        await self._progress()
        counters = self.sampler_counters
        seen = counters() if counters is not None else None
        pending = asyncio.ensure_future(self.collector.collect(self.start_step))
        # The step compiles while the first rollouts are collected (minutes at real size).
        warm = (
            asyncio.ensure_future(asyncio.to_thread(self.warmup_step))
            if cfg.compile_ahead
            else None
        )
        for s in range(self.start_step, cfg.steps):
            t0 = time.perf_counter()
            with stage("collection"):
                traces = await pending
                extra: dict[str, Any] = {}
                if cfg.dynamic_sampling:  # before the next step's collection starts
                    traces, extra = await self._refill(s, traces)
            if self.mixer is not None:  # the next step's tasks are drawn with the new weights
                self.mixer.update(traces)
                extra.update(self.mixer.metrics())
            t_sample = time.perf_counter() - t0
            backoff = getattr(self.collector, "backoff_s", None)
            if isinstance(backoff, float):  # EndpointCollector: infra reruns' waits
                extra["infra_backoff_s"] = backoff - self._backoff_seen
                self._backoff_seen = backoff
            if counters is not None and seen is not None:
                now = counters()
                extra.update(
                    {
                        f"sampler/{k}": v
                        for k, v in occupancy_metrics(seen, now, now["max_batch"]).items()
                    }
                )
                seen = now
            if cfg.mode == "async" and s + 1 < cfg.steps:
                pending = asyncio.ensure_future(self.collector.collect(s + 1))
            t1 = time.perf_counter()
            if warm is not None:
                await warm  # done by now, or the update would compile the same anyway
                warm = None
            self.last_traces = list(traces)
            with stage("train step"):
                m = await asyncio.to_thread(self.update, traces)
            m.update(extra)
            t2 = time.perf_counter()
            m["policy_version"] = self.version
            if m["policy_version"] != self._published:
                # Off the event loop: rollouts of the next step keep streaming meanwhile.
                with stage("publish"):
                    await self._await_write()  # the last write first (`_hand_off` joins it)
                    await asyncio.to_thread(self._publish, self._checkpoints(s))
                await self.check_served(f"rl_step {s}, after publishing version {self._published}")
            t3 = time.perf_counter()
            m.update(
                rl_step=s,
                time_sampling_s=t_sample,
                time_training_s=t2 - t1,
                time_publishing_s=t3 - t2,
                time_step_s=time.perf_counter() - t0,
            )
            m.update(self.alarm_metrics())
            if self._writing is not None:  # a step without a publish: nothing joined it
                with stage("publish"):  # Orbax saves must not overlap (see `_hand_off`)
                    await self._await_write()
            if self._checkpoints(s):  # the folder follows the checkpoints (`_publish`)
                await asyncio.to_thread(self._write_folder)
            self.trainer.end_step(m)  # logs train/..., checkpoints (steps done = s + 1)
            if (s + 1) % cfg.checkpoint_every and s + 1 == cfg.steps:
                self.trainer.save()  # the last step checkpoints off the cadence too
            self._write_behind()  # the hand-off's publish, once the checkpoint save began
            self.history.append(m)  # before on_progress, which may read it
            await self._progress()
            if cfg.mode == "sync" and s + 1 < cfg.steps:
                pending = asyncio.ensure_future(self.collector.collect(s + 1))
        self._write_behind()
        await self._await_write()  # it waits for the checkpoint first
        self.trainer.wait()
        return self.history

    def _checkpoints(self, rl_step: int) -> bool:
        """Whether loop step `rl_step` ends with a checkpoint (`RLConfig.checkpoint_every`,
        and the run's last step)."""
        done = rl_step + 1
        return done % self.config.checkpoint_every == 0 or done == self.config.steps

    def close(self) -> None:
        try:
            self.wait_published()
        finally:
            if self._writer is not None:
                self._writer.shutdown(wait=True)
                self._writer = None
            self.trainer.close()
