"""The recipes' configs: one typed schema per recipe, one place per setting.

Each recipe config is a frozen dataclass of sections; the library's own
configs (`RLConfig`, `SFTConfig`, `DistillConfig`, `OptimizerConfig`,
`HintConfig`) are sections as they are, never copied: RL concurrency is
`rl.concurrency` and nothing else (the collector and the sampler's batch
follow it). Every field can be set from the command line
(`--config.rl.optimizer.learning_rate=5e-4`, `ac2_jax.config_cli`).

`tool_parser` (every recipe): the format tool calls are parsed in, in training
and serving; None picks it from the model (`Tokenizer.from_pretrained`).

`lora` (every recipe): None trains every weight; a `LoRAConfig`
(`--config.lora.rank=16`) trains low-rank adapters on the model as loaded
(its weights frozen): the optimizer holds the adapters only, the sampler
serves base + adapters, each publish sends the adapters alone, and the
export is the merged HF checkpoint plus the adapters in PEFT's format.
"""

from __future__ import annotations

import dataclasses
import os

from ac2_jax.models.lora import LoRAConfig
from ac2_jax.sampling.registry import SamplerConfig  # kind: jax, sglang, fleet, ...
from ac2_jax.training import DistillConfig, OptimizerConfig, RLConfig, SFTConfig
from ac2_jax.training.distill.data import HintConfig
from ac2_jax.training.rl.alarms import AlarmsConfig

EXISTING = ("refuse", "resume", "overwrite")


@dataclasses.dataclass(frozen=True)
class PathsConfig:
    """Where a run writes. Each location but `workdir` defaults to a folder in it."""

    workdir: str = "runs/run"
    publish: str | None = None  # published weights the sampler loads (workdir/published)
    traces: str | None = None  # every served trace and the rollouts (workdir/traces)
    reports: str | None = None  # report.json, config.json, HF export (workdir/report)
    metrics: str | None = None  # metrics.jsonl + TensorBoard (workdir/metrics)
    # What a workdir that holds a run of the recipe gets (the launcher's --resume and
    # --overwrite): "refuse" (an error naming both), "resume" (continue from its
    # checkpoint; its saved config is compared first: another model or full <-> LoRA
    # is refused, other changes are named), "overwrite" (its files are deleted first).
    existing: str = "refuse"

    def __post_init__(self):
        if self.existing not in EXISTING:
            raise ValueError(
                f"paths.existing must be one of {EXISTING} (the launcher's --resume / "
                f"--overwrite), got {self.existing!r}"
            )

    def resolved(self) -> RunPaths:
        """Every location as an absolute path."""
        work = os.path.abspath(self.workdir)

        def pick(value: str | None, default: str) -> str:
            return os.path.abspath(value) if value else os.path.join(work, default)

        return RunPaths(
            workdir=work,
            publish=pick(self.publish, "published"),
            traces=pick(self.traces, "traces"),
            reports=pick(self.reports, "report"),
            metrics=pick(self.metrics, "metrics"),
        )


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """`PathsConfig.resolved()`: every location, absolute."""

    workdir: str
    publish: str
    traces: str
    reports: str
    metrics: str


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How each attempt samples and runs (the harness's sampling and limits)."""

    temperature: float = 1.0  # sampling temperature of the training attempts
    max_tokens: int = 128  # per request; also the endpoint's default for requests without one
    max_steps: int = 4  # requests per attempt (the default tool-loop harness)
    infra_retries: int = 2  # reruns of an attempt that ended infra_error (ours, never trained)
    # Wait before infra rerun r: uniform in [d/2, d], d = min(max, backoff x 2^(r-1)) seconds.
    infra_backoff_s: float = 1.0  # d of the first rerun, seconds (0: rerun at once)
    infra_backoff_max_s: float = 30.0  # the cap of d, seconds
    deadline_s: float | None = None  # wall-clock bound of one attempt (None: none)

    def __post_init__(self):
        if self.max_tokens < 1 or self.max_steps < 1:
            raise ValueError("RolloutConfig: max_tokens and max_steps must be >= 1")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation before and after training (num_tasks=0: none)."""

    num_tasks: int = 0
    attempts: int = 1  # attempts per task (pass@k and its CI over them)
    temperature: float = 0.0  # sampling temperature of the eval attempts (0: greedy)
    concurrency: int = 16  # eval attempts in flight at once
    # USD per million tokens {cached_input, uncached_input, output} for the cost figures.
    prices: dict[str, float] | None = None


@dataclasses.dataclass(frozen=True)
class LogConfig:
    """What the run shows and where metrics go (metrics.jsonl always)."""

    progress: bool = True  # one compact line per step of each phase (rate, ETA)
    # learning_curve.png, trace_<i>.html (SFT: demo_<i>.html) and, for distillation,
    # distill_report.html (the divergence heatmap) in the report folder
    report_files: bool = True
    tensorboard: bool = True  # TensorBoard event files beside metrics.jsonl
    wandb: bool = False  # Weights & Biases (needs `pip install wandb`)
    wandb_project: str | None = None  # the W&B project (None: W&B's default)


@dataclasses.dataclass(frozen=True)
class MixConfig:
    """The weights of a several-domain env (a `DomainMixer`, e.g.
    `--env=reasoning_gym:a,b,c`). adaptive: each domain's weight from its rolling pass
    rate (`envs.AdaptiveMix`: the last `window` results, at least `floor` of its fixed
    share, rate 0.5 before `min_results`; solved: reward >= pass_threshold); the
    console shows the mix each step and the report its curves (mix.jsonl, mix.png).
    adaptive with a one-domain env is refused."""

    adaptive: bool = False
    window: int = 64
    floor: float = 0.1
    min_results: int = 8
    pass_threshold: float = 1.0


@dataclasses.dataclass(frozen=True)
class DemosConfig:
    """SFT data: `num_tasks` train tasks solved by the env's `demonstration(task)`,
    or a JSONL `file` of chats ({"messages": [...], "tools": [...]?} per line)."""

    num_tasks: int = 64
    file: str | None = None


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """The learner's device mesh on this machine (`training.make_mesh`): batch rows split
    over data x fsdp devices, params over fsdp and tensor. 1/1/1: one device (the
    default); a product above the machine's device count is refused by name. The
    embedded sampler serves from the default device either way."""

    data: int = 1  # data-parallel ways (batch rows split; params replicated)
    fsdp: int = 1  # fully-sharded ways (batch rows split; params and moments sharded)
    tensor: int = 1  # tensor-parallel ways (params' heads/mlp dimensions sharded)

    def __post_init__(self):
        if min(self.data, self.fsdp, self.tensor) < 1:
            raise ValueError(
                f"mesh.data, mesh.fsdp and mesh.tensor must be >= 1, got "
                f"{self.data}/{self.fsdp}/{self.tensor}"
            )


@dataclasses.dataclass(frozen=True)
class RLRecipeConfig:
    seed: int = 0  # seeds tasks, sampling, init and shuffles: a run repeats with it
    paths: PathsConfig = PathsConfig()
    rl: RLConfig = RLConfig(
        steps=10, tasks_per_step=4, attempts_per_task=4, concurrency=16, compile_ahead=False
    )
    rollout: RolloutConfig = RolloutConfig()
    sampler: SamplerConfig = SamplerConfig()
    eval: EvalConfig = EvalConfig()
    log: LogConfig = LogConfig()
    lora: LoRAConfig | None = None  # train adapters only (see the module docstring)
    # The model's tool-call format (text.tool_parsers: hermes, llama3_json, mistral,
    # qwen3_coder, gemma_tool_code); None: its chat template's, else its family's.
    tool_parser: str | None = None
    mix: MixConfig = MixConfig()  # a several-domain env's weights, fixed or adaptive
    mesh: MeshConfig = MeshConfig()  # the learner's devices (data x fsdp x tensor)
    # Correctness alarms, on by default (training.rl.alarms): weights served = published,
    # sampler/learner drift, hangs; each a threshold and an action (warn | stop | off),
    # e.g. --config.alarms.drift.action=stop, --config.alarms.enabled=false (all off).
    alarms: AlarmsConfig = AlarmsConfig()


@dataclasses.dataclass(frozen=True)
class SFTRecipeConfig:
    seed: int = 0  # seeds tasks, sampling, init and shuffles: a run repeats with it
    paths: PathsConfig = PathsConfig()
    demos: DemosConfig = DemosConfig()
    # The SFT loop and data. seq_len 1024: a tool prompt (a template's tool preamble +
    # schemas + a demo) is several hundred tokens, SFTConfig's 256 below one; a longer
    # demo is refused by name.
    sft: SFTConfig = SFTConfig(steps=100, checkpoint_every=50, seq_len=1024)
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-4)
    log: LogConfig = LogConfig()
    lora: LoRAConfig | None = None  # train adapters only (see the module docstring)
    # The model's tool-call format (text.tool_parsers: hermes, llama3_json, mistral,
    # qwen3_coder, gemma_tool_code); None: its chat template's, else its family's.
    tool_parser: str | None = None
    mesh: MeshConfig = MeshConfig()  # the learner's devices (data x fsdp x tensor)


@dataclasses.dataclass(frozen=True)
class DistillLoopConfig:
    """Each step rolls out `tasks_per_step` train tasks `attempts_per_task` times
    through the endpoint with the current policy, attaches each task's hint
    (`env.hint(task)`) and distills the traces (`examples_from_traces`).
    only_failures: distill only the attempts the verifier failed (reward below
    `pass_reward`; an attempt with no reward counts as failed); the passed ones
    are counted (data/passed_traces), never taught.
    hints: attach the env's hints to the teacher's prompt; false (with
    `distill.teacher` naming a teacher model only) is plain on-policy distillation:
    the teacher reads the student's own prompt and the env needs no `hint`."""

    steps: int = 10  # distillation steps (each: roll out, teach, publish)
    tasks_per_step: int = 4
    attempts_per_task: int = 1
    concurrency: int = 16  # attempts in flight at once (the sampler's batch follows it)
    judge: str = "keywords"  # RMSD's judge: "keywords" or "diff" (a RuleJudge)
    only_failures: bool = False
    pass_reward: float = 1.0
    hints: bool = True

    def __post_init__(self):
        if min(self.steps, self.tasks_per_step, self.attempts_per_task, self.concurrency) < 1:
            raise ValueError("DistillLoopConfig: steps, tasks and concurrency must be >= 1")


@dataclasses.dataclass(frozen=True)
class DistillRecipeConfig:
    seed: int = 0  # seeds tasks, sampling, init and shuffles: a run repeats with it
    paths: PathsConfig = PathsConfig()
    loop: DistillLoopConfig = DistillLoopConfig()
    distill: DistillConfig = DistillConfig(seq_len=512, rows=2, checkpoint_every=1)
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-4)
    hint: HintConfig = HintConfig()
    rollout: RolloutConfig = RolloutConfig()
    sampler: SamplerConfig = SamplerConfig()
    eval: EvalConfig = EvalConfig()
    log: LogConfig = LogConfig()
    lora: LoRAConfig | None = None  # train adapters only (see the module docstring)
    # The model's tool-call format (text.tool_parsers: hermes, llama3_json, mistral,
    # qwen3_coder, gemma_tool_code); None: its chat template's, else its family's.
    tool_parser: str | None = None
    mesh: MeshConfig = MeshConfig()  # the learner's devices (data x fsdp x tensor)
