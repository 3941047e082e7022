"""On-policy data for self-distillation: sample a turn, or roll out and grade.

`generate` is a plain jitted batch decode over the model's KV cache (greedy
or temperature sampling, no top-k / top-p), enough for single-turn
resampling inside a training loop without a sampler service. Prompt rows and
lengths are bucketed (powers of two) so a few compiles serve a run.

Log-probs follow the Sampler contract (`ac2_jax.sampling.base`): each
recorded log-prob is that of the distribution the token was sampled from,
`log_softmax(logits / temperature)`; greedy decoding (temperature 0) records
the raw `log_softmax(logits)`. The examples carry the parameters
(`DistillExample.temperature`, `top_k` = 0 and `top_p` = 1: off), as a
Completion does.

(b) `resample_examples`: sample one response per prompt from the current
policy (source="student": on-policy OPSD/RMSD data; source="teacher": the
hint-conditioned output, for the SFT-on-hinted-outputs baseline).
(c) `rollout_and_grade`: sample, grade each response with a `Grader` that
returns a hint for a failure (None for a pass), and turn the failures into
distillation examples with those hints.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ac2_jax.training.distill.data import DistillExample, HintConfig, insert_hint

SOURCES = ("student", "teacher")


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new"))
def _generate(graphdef, params, rest, tokens, lengths, stop_ids, temperature, key, *, max_new):
    """tokens [B, T] (right-padded), lengths [B] -> (out [B, max_new] (-1 after a stop), logp)."""
    model = nnx.merge(graphdef, params, rest)
    B, T = tokens.shape
    cache = model.init_cache(B, T + max_new)
    cols = jnp.arange(T)[None, :]
    pos = jnp.where(cols < lengths[:, None] - 1, cols, -1)  # last prompt token goes in step 0
    _, cache = model.decode(tokens, pos, cache, logits_at=jnp.zeros((B,), jnp.int32))
    last = jnp.take_along_axis(tokens, (lengths - 1)[:, None], axis=1)[:, 0]

    def body(carry, i):
        tok, cache, done, key = carry
        p = jnp.where(done, -1, lengths - 1 + i)
        logits, cache = model.decode(tok[:, None], p[:, None], cache)
        logits = logits[:, 0]
        key, sub = jax.random.split(key)
        t = jnp.maximum(temperature, 1e-6)
        sampled = jax.random.categorical(sub, logits / t).astype(jnp.int32)
        nxt = jnp.where(temperature > 0, sampled, jnp.argmax(logits, -1).astype(jnp.int32))
        lp = jnp.take_along_axis(jax.nn.log_softmax(logits / jnp.where(temperature > 0, t, 1.0)),
                                 nxt[:, None], axis=1)[:, 0]
        out = jnp.where(done, -1, nxt)
        done = done | jnp.any(nxt[:, None] == stop_ids[None, :], axis=1)
        return (nxt, cache, done, key), (out, jnp.where(out >= 0, lp, 0.0))

    init = (last, cache, jnp.zeros((B,), bool), key)
    _, (out, lps) = jax.lax.scan(body, init, jnp.arange(max_new))
    return out.T, lps.T


def _bucket(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, n - 1).bit_length())


def generate(graphdef, params, rest, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             stop_token_ids: Sequence[int], temperature: float = 0.0, seed: int = 0,
             min_batch: int = 1) -> list[tuple[list[int], list[float]]]:
    """One continuation per prompt: (output ids incl. the stop token, their log-probs).

    temperature 0 is greedy and records the raw log_softmax(logits); T > 0
    samples from and records log_softmax(logits / T), the distribution
    sampled (no top-k / top-p here). A row stops at its first stop token or
    after max_new_tokens.
    Rows are padded to a power of two >= min_batch (fewer compiled shapes).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generate: need at least one prompt, and no empty prompt")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    if not stop_token_ids:
        raise ValueError("generate: stop_token_ids is empty")
    n = len(prompts)
    B = _bucket(max(n, min_batch), 1)
    T = _bucket(max(len(p) for p in prompts), 32)
    tokens = np.zeros((B, T), np.int32)
    lengths = np.ones((B,), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
        lengths[i] = len(p)
    out, lps = _generate(graphdef, params, rest, tokens, lengths,
                         jnp.asarray(list(stop_token_ids), jnp.int32), jnp.float32(temperature),
                         jax.random.PRNGKey(seed), max_new=int(max_new_tokens))
    out, lps = np.asarray(out), np.asarray(lps)
    results = []
    for i in range(n):
        k = int((out[i] >= 0).sum())
        results.append((out[i, :k].tolist(), lps[i, :k].tolist()))
    return results


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
    """How `resample_examples` / `rollout_and_grade` sample (temperature 0: greedy)."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    min_batch: int = 1

    def kwargs(self) -> dict:
        return dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                    min_batch=self.min_batch)


class PromptCache:
    """Memoizes `insert_hint` per (task, hint): prompts repeat across steps."""

    def __init__(self, tokenizer, config: HintConfig = HintConfig()):
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
            self._memo[key] = self.tokenizer.apply_chat_template(list(task.messages),
                                                                 tokenize=True)
        return self._memo[key]


def _example(task, hint, prompts, response, logprobs, sampling: "SampleConfig"):
    student, teacher, span = prompts(task, hint)
    return DistillExample(student, teacher, response, hint, task.task_id, hint_span=span,
                          response_logprobs=logprobs, messages=list(task.messages),
                          temperature=float(sampling.temperature), top_k=0, top_p=1.0)


def resample_examples(graphdef, params, rest, tasks: Sequence[HintTask], prompts: PromptCache,
                      sampling: SampleConfig = SampleConfig(), *, source: str = "student",
                      seed: int = 0) -> list[DistillExample]:
    """(b) One fresh response per hinted task from the policy (params).

    source="student" samples from the plain prompt (on-policy distillation);
    "teacher" samples from the hinted prompt (SFT-on-hinted-outputs data).
    Empty responses are dropped.
    """
    if source not in SOURCES:
        raise ValueError(f"resample_examples: source must be one of {SOURCES}, got {source!r}")
    missing = [t.task_id for t in tasks if not t.hint]
    if missing:
        raise ValueError(f"resample_examples: tasks without a hint: {missing[:5]}")
    pairs = [prompts(t, t.hint) for t in tasks]
    ctx = [p[0] if source == "student" else p[1] for p in pairs]
    outs = generate(graphdef, params, rest, ctx, stop_token_ids=prompts.tokenizer.stop_token_ids,
                    seed=seed, **sampling.kwargs())
    return [_example(t, t.hint, prompts, ids, lps, sampling)
            for t, (ids, lps) in zip(tasks, outs) if ids]


@dataclasses.dataclass
class Graded:
    task: HintTask
    response: list[int]
    text: str
    hint: str | None

    @property
    def passed(self) -> bool:
        return self.hint is None


def rollout_and_grade(graphdef, params, rest, tasks: Sequence[HintTask], grader: Grader,
                      prompts: PromptCache, sampling: SampleConfig = SampleConfig(), *,
                      seed: int = 0) -> tuple[list[DistillExample], list[Graded]]:
    """(c) Roll out each task, grade it, and return (examples for the failures, all grades).

    A failure's example pairs the student's own response with a teacher
    prompt carrying the grader's hint.
    """
    ctx = [prompts.student(t) for t in tasks]
    outs = generate(graphdef, params, rest, ctx, stop_token_ids=prompts.tokenizer.stop_token_ids,
                    seed=seed, **sampling.kwargs())
    graded, examples = [], []
    for t, (ids, lps) in zip(tasks, outs):
        text = prompts.tokenizer.decode(ids, skip_special_tokens=True)
        hint = grader(t, text)
        graded.append(Graded(t, ids, text, hint))
        if hint is not None and ids:
            examples.append(_example(t, hint, prompts, ids, lps, sampling))
    return examples, graded
