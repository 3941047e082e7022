"""On-policy data for self-distillation: sample a turn, or roll out and grade.

Sampling goes through the `Sampler` protocol (`ac2_jax.sampling.base`; the
embedded `JaxSampler` or SGLang), the one decode loop: each recorded
log-prob is that of the distribution the token was sampled from,
`log_softmax(sampling_logits(logits, temperature, top_k, top_p))`, greedy
(temperature 0) the raw `log_softmax(logits)`, as for every Completion; the
examples carry those parameters (`DistillExample.temperature` / `top_k` /
`top_p`). The driver keeps the sampler on the current policy with
`ac2_jax.training.publish(..., sampler=)` (publish the train state, then
`sampler.load_weights`, or `set_params` in memory).

(b) `resample_examples`: sample one response per prompt from the current
policy (source="student": on-policy OPSD/RMSD data; source="teacher": the
hint-conditioned output, for the SFT-on-hinted-outputs baseline).
(c) `rollout_and_grade`: sample, grade each response with a `Grader` that
returns a hint for a failure (None for a pass), and turn the failures into
distillation examples with those hints.
Each has an async form (`aresample_examples`, `arollout_and_grade`) for
callers inside an event loop; the plain forms run it through the library's one
sync runner (`ac2_jax._sync.run_sync`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ac2_jax._sync import run_sync
from ac2_jax.sampling.base import Sampler, SampleResult, SamplingParams
from ac2_jax.training.core.checkpoints import publish
from ac2_jax.training.distill.data import DistillExample, HintConfig, insert_hint

_DEFAULT_HINT = HintConfig()

SOURCES = ("student", "teacher")


def publish_policy(
    sampler: Sampler, graphdef, state, publish_dir: str | os.PathLike, step: int, keep: int = 2,
    *, in_memory: bool = False,
) -> int:  # fmt: skip
    """Deprecated (goes in the next release): `ac2_jax.training.publish(graphdef, state,
    publish_dir, step, keep, sampler=sampler, in_memory=in_memory)`, the one publish
    verb. Returns the sampler's policy_version."""
    warnings.warn(
        "ac2_jax.training.distill.publish_policy is deprecated and goes in the next release: "
        "use ac2_jax.training.publish(graphdef, state, publish_dir, step, sampler=sampler)",
        DeprecationWarning,
        stacklevel=2,
    )
    publish(graphdef, state, publish_dir, step, keep=keep, sampler=sampler, in_memory=in_memory)
    return int(sampler.policy_version)


@dataclasses.dataclass(frozen=True)
class HintTask:
    """A chat prompt to sample from; `hint` is used by `resample_examples`."""

    task_id: str
    messages: tuple
    hint: str | None = None
    data: Any = None


# (task, response text) -> None when the response passes, else a hint for the teacher.
Grader = Callable[[HintTask, str], "str | None"]


@dataclasses.dataclass(frozen=True)
class SampleConfig:
    """How `resample_examples` / `rollout_and_grade` sample (temperature 0: greedy).

    top_k <= 0 and top_p = 1 are off. min_batch is not a request field: it is
    for the driver that builds the sampler (`JaxSampler(min_batch=)`).
    """

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_batch: int = 1

    def params(self, stop_token_ids: Sequence[int], seed: int) -> SamplingParams:
        """The request's SamplingParams (ValueError naming a bad field)."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=max(int(self.top_k), 0),
            top_p=self.top_p,
            max_tokens=self.max_new_tokens,
            stop_token_ids=tuple(stop_token_ids),
            seed=seed,
        )


async def asample(
    sampler: Sampler,
    prompts: Sequence[Sequence[int]],
    sampling: SampleConfig,
    *,
    stop_token_ids: Sequence[int],
    seed: int = 0,
) -> list[SampleResult]:
    """One continuation per prompt, requested concurrently (prompt i: seed + i).

    Each result holds the sampled ids (with the stop token that ended it) and
    their log-probs under the sampled distribution (see the module docstring).
    """
    if not prompts:
        raise ValueError("sample: no prompts")
    return list(
        await asyncio.gather(
            *(
                sampler.generate(list(p), sampling.params(stop_token_ids, seed + i))
                for i, p in enumerate(prompts)
            )
        )
    )


def sample(
    sampler: Sampler,
    prompts: Sequence[Sequence[int]],
    sampling: SampleConfig,
    *,
    stop_token_ids: Sequence[int],
    seed: int = 0,
) -> list[SampleResult]:
    """`asample` from sync code."""
    return run_sync(
        asample(sampler, prompts, sampling, stop_token_ids=stop_token_ids, seed=seed), "sample"
    )


class PromptCache:
    """Memoizes `insert_hint` per (task, hint): prompts repeat across steps."""

    def __init__(self, tokenizer, config: HintConfig = _DEFAULT_HINT):
        self.tokenizer, self.config = tokenizer, config
        self._memo: dict = {}

    def __call__(self, task: HintTask, hint: str):
        key = (task.task_id, hint)
        if key not in self._memo:
            self._memo[key] = insert_hint(self.tokenizer, list(task.messages), hint, self.config)
        return self._memo[key]

    def student(self, task: HintTask) -> list[int]:
        key = (task.task_id, None)
        if key not in self._memo:
            self._memo[key] = self.tokenizer.apply_chat_template(list(task.messages), tokenize=True)
        return self._memo[key]


def _example(task, hint, prompts, res: SampleResult, sampling: SampleConfig):
    student, teacher, span = prompts(task, hint)
    return DistillExample(
        student,
        teacher,
        list(res.output_ids),
        hint,
        task.task_id,
        hint_span=span,
        response_logprobs=list(res.output_logprobs),
        messages=list(task.messages),
        temperature=float(sampling.temperature),
        top_k=max(int(sampling.top_k), 0),
        top_p=float(sampling.top_p),
    )


async def aresample_examples(
    sampler: Sampler,
    tasks: Sequence[HintTask],
    prompts: PromptCache,
    sampling: SampleConfig = SampleConfig(),
    *,
    source: str = "student",
    seed: int = 0,
) -> list[DistillExample]:
    """(b) One fresh response per hinted task from the sampler's policy.

    source="student" samples from the plain prompt (on-policy distillation);
    "teacher" samples from the hinted prompt (SFT-on-hinted-outputs data).
    """
    if source not in SOURCES:
        raise ValueError(f"resample_examples: source must be one of {SOURCES}, got {source!r}")
    missing = [t.task_id for t in tasks if not t.hint]
    if missing:
        raise ValueError(f"resample_examples: tasks without a hint: {missing[:5]}")
    pairs = [prompts(t, t.hint or "") for t in tasks]  # every hint is set (checked above)
    ctx = [p[0] if source == "student" else p[1] for p in pairs]
    outs = await asample(
        sampler, ctx, sampling, stop_token_ids=prompts.tokenizer.stop_token_ids, seed=seed
    )
    return [_example(t, t.hint, prompts, res, sampling) for t, res in zip(tasks, outs, strict=True)]


def resample_examples(
    sampler: Sampler,
    tasks: Sequence[HintTask],
    prompts: PromptCache,
    sampling: SampleConfig = SampleConfig(),
    *,
    source: str = "student",
    seed: int = 0,
) -> list[DistillExample]:
    """`aresample_examples` from sync code."""
    return run_sync(
        aresample_examples(sampler, tasks, prompts, sampling, source=source, seed=seed),
        "resample_examples",
    )


@dataclasses.dataclass
class Graded:
    task: HintTask
    response: list[int]
    text: str
    hint: str | None

    @property
    def passed(self) -> bool:
        return self.hint is None


async def arollout_and_grade(
    sampler: Sampler,
    tasks: Sequence[HintTask],
    grader: Grader,
    prompts: PromptCache,
    sampling: SampleConfig = SampleConfig(),
    *,
    seed: int = 0,
) -> tuple[list[DistillExample], list[Graded]]:
    """(c) Roll out each task, grade it, and return (examples for the failures, all grades).

    A failure's example pairs the student's own response with a teacher
    prompt carrying the grader's hint.
    """
    ctx = [prompts.student(t) for t in tasks]
    outs = await asample(
        sampler, ctx, sampling, stop_token_ids=prompts.tokenizer.stop_token_ids, seed=seed
    )
    graded, examples = [], []
    for t, res in zip(tasks, outs, strict=True):
        text = prompts.tokenizer.decode(res.output_ids, skip_special_tokens=True)
        hint = grader(t, text)
        graded.append(Graded(t, list(res.output_ids), text, hint))
        if hint is not None:
            examples.append(_example(t, hint, prompts, res, sampling))
    return examples, graded


def rollout_and_grade(
    sampler: Sampler,
    tasks: Sequence[HintTask],
    grader: Grader,
    prompts: PromptCache,
    sampling: SampleConfig = SampleConfig(),
    *,
    seed: int = 0,
) -> tuple[list[DistillExample], list[Graded]]:
    """`arollout_and_grade` from sync code."""
    return run_sync(
        arollout_and_grade(sampler, tasks, grader, prompts, sampling, seed=seed),
        "rollout_and_grade",
    )
