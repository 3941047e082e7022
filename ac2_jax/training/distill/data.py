"""Self-distillation data: hint insertion, paired student/teacher batches, sources.

The student sees `prompt ++ y` (its own response y); the teacher sees the same
prompt with a hint inserted, then the same y. `insert_hint` builds the teacher
prompt ids as the student prompt ids with one contiguous run of tokens
inserted (placement "system", "before_turn" or "after_user"), so everything
but the hint is token-for-token what the student saw. `pack_pairs` packs
student and teacher sequences with the same row/segment layout and gives, for
every student column, the teacher column that predicts the same response
token (`teacher_index`); the response positions then line up exactly.

A DistillExample's `response` may hold several output spans of one
append-only episode (`response_mask` 1 on each, 0 on the tool results and
other context between them): one forward pass then trains every turn.
`loss_mask` of the packed batch COUNTS trained predictions (1 each; it
defines the task_mean normaliser); the example's `weight` goes to
`loss_weight`, which multiplies the loss.

Data sources (each returns `DistillExample`s):
(a) `ac2_jax.training.distill.traces.examples_from_traces`: stored traces +
    their hints (offline), every completion of every episode (main,
    compactor, subagents) by default;
(b)/(c) `ac2_jax.training.distill.sources`: resample a turn with the current
policy, or roll out, grade and distill the failures with generated hints.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from ac2_jax.segments import PackedBatch, Segment
from ac2_jax.segments.batch import empty_batch, pad_rows, pow2_bucket
from ac2_jax.segments.packing import pack_rows, write_segment
from ac2_jax.segments.segments import SAMPLER_LOGPROBS

HINT_PLACEMENTS = ("system", "before_turn", "after_user")
# Per-token features pack_pairs adds (1 on an example's response where it recorded
# them, else 0): its sampling parameters (the batch's temperature / top_k / top_p
# there are then the recorded ones) and, with them, its behaviour log-probs
# (`SAMPLER_LOGPROBS`). DistillLoss(kind="sampled") reads them.
SAMPLING_RECORDED = "sampling_recorded"
LOGPROBS_RECORDED = "logprobs_recorded"


@dataclasses.dataclass(frozen=True)
class HintConfig:
    """Where and how the hint enters the teacher's context.

    placement: "system" (appended to the system message, or a new first
    system message), "before_turn" (a new `role` message just before the
    response) or "after_user" (appended to the last user message).
    template formats the hint ("{hint}" is replaced); separator joins it to
    existing content.
    """

    placement: str = "before_turn"
    template: str = "{hint}"
    role: str = "system"
    separator: str = "\n\n"

    def __post_init__(self):
        if self.placement not in HINT_PLACEMENTS:
            raise ValueError(
                f"HintConfig.placement must be one of {HINT_PLACEMENTS}, got {self.placement!r}"
            )
        if "{hint}" not in self.template:
            raise ValueError(f"HintConfig.template must contain '{{hint}}', got {self.template!r}")

    def text(self, hint: str) -> str:
        return self.template.replace("{hint}", hint)


def hinted_messages(
    messages: Sequence[dict], hint: str, config: HintConfig = HintConfig()
) -> list[dict]:
    """The teacher's messages: a copy of `messages` with the hint inserted."""
    if not hint:
        raise ValueError("hinted_messages: the hint is empty")
    msgs = [dict(m) for m in messages]
    text = config.text(hint)
    if config.placement == "system":
        if msgs and msgs[0].get("role") == "system":
            msgs[0]["content"] = (msgs[0].get("content") or "") + config.separator + text
        else:
            msgs.insert(0, {"role": "system", "content": text})
    elif config.placement == "after_user":
        users = [i for i, m in enumerate(msgs) if m.get("role") == "user"]
        if not users:
            raise ValueError("hinted_messages: placement 'after_user' needs a user message")
        m = msgs[users[-1]]
        m["content"] = (m.get("content") or "") + config.separator + text
    else:
        msgs.append({"role": config.role, "content": text})
    return msgs


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n = 0
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def _pick_split(tokenizer, tt, p, n, text) -> int:
    """Where the n inserted ids start: p or a shift left that inserts the same ids.

    A run can slide left while the token before it equals its last token;
    prefer a run holding the whole hint text that opens with a special token
    (a new message), else the rightmost one (text appended to a message).
    """
    valid = [p]
    while valid[-1] > 0 and tt[valid[-1] - 1] == tt[valid[-1] - 1 + n]:
        valid.append(valid[-1] - 1)
    special = set(tokenizer.hf.get_added_tokens_decoder())
    holds = [q for q in valid if text in tokenizer.decode(tt[q : q + n])] or valid
    return next((q for q in holds if tt[q] in special), holds[0])


def _anchor(student_text: str, stored_text: str, chars: int) -> int | None:
    """Offset in `stored_text` of offset `chars` of `student_text`, or None.

    The stored prompt can render more than the messages (tool schemas, which
    `Completion.messages` does not hold) and spliced turns can differ from
    the template's text. The hint goes where the same text precedes it
    (common prefix), else where the same text follows it (common suffix),
    else inside a block both texts share (a diff of the rest).
    """
    s, d = student_text, stored_text
    cp = len(os.path.commonprefix([s, d]))
    if chars <= cp:
        return chars
    n = min(len(s), len(d)) - cp
    cs = len(os.path.commonprefix([s[::-1][:n], d[::-1][:n]]))
    if chars >= len(s) - cs:
        return len(d) - (len(s) - chars)
    a, b, x = s[cp : len(s) - cs], d[cp : len(d) - cs], chars - cp
    for tag, i1, i2, j1, _ in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal" and i1 <= x <= i2:
            return cp + j1 + (x - i1)
    return None


def _token_boundary(tokenizer, ids: list[int], text: str, chars: int) -> int | None:
    """k with decode(ids[:k]) == text[:chars] (text = decode(ids)), or None."""
    lo, hi = 0, len(ids)
    while lo < hi:  # smallest k whose decoded prefix reaches `chars`
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[:mid])) >= chars:
            hi = mid
        else:
            lo = mid + 1
    return lo if tokenizer.decode(ids[:lo]) == text[:chars] else None


def _contents(messages: Sequence[dict]) -> list[str]:
    return [
        m["content"].strip()
        for m in messages
        if isinstance(m.get("content"), str) and m["content"].strip()
    ]


def insert_hint(
    tokenizer,
    messages: Sequence[dict],
    hint: str,
    config: HintConfig = HintConfig(),
    prompt_ids: Sequence[int] | None = None,
) -> tuple[list[int], list[int], tuple[int, int]]:
    """(student ids, teacher ids, (start, end)): teacher = student with ids inserted at start.

    Both prompts end with the generation prompt. `prompt_ids` (e.g. a stored
    completion's, possibly spliced, possibly rendered with tool schemas)
    default to the template rendering of `messages`; they must decode to a
    text holding every message's content. The inserted ids are those the
    template gives for the hint; they enter the stored ids where the
    rendering of `messages` puts them (see `_anchor`). Raises ValueError when
    the hint cannot enter as one contiguous token run.
    """
    student_text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
    teacher_text = tokenizer.apply_chat_template(
        hinted_messages(messages, hint, config), add_generation_prompt=True
    )
    canon, tt = tokenizer.encode(student_text), tokenizer.encode(teacher_text)
    p = _common_prefix(canon, tt, min(len(canon), len(tt)))
    s = _common_prefix(canon[::-1], tt[::-1], min(len(canon), len(tt)) - p)
    if p + s != len(canon) or len(tt) <= len(canon):
        raise ValueError(
            "insert_hint: the hint changes the tokenization of the surrounding "
            f"context (placement {config.placement!r}); use another placement "
            "or template"
        )
    p = _pick_split(tokenizer, tt, p, len(tt) - len(canon), config.text(hint))
    ins = tt[p : p + len(tt) - len(canon)]
    if prompt_ids is None or list(prompt_ids) == canon:
        return list(canon), list(tt), (p, p + len(ins))
    ids = [int(t) for t in prompt_ids]
    stored = tokenizer.decode(ids)
    pos = 0
    for c in _contents(messages):
        pos = stored.find(c, pos)
        if pos < 0:
            raise ValueError(
                "insert_hint: prompt_ids do not decode to a rendering of messages "
                f"(no {c[:40]!r}); pass the messages of that request"
            )
    at = _anchor(student_text, stored, len(tokenizer.decode(canon[:p])))
    k = None if at is None else _token_boundary(tokenizer, ids, stored, at)
    if k is None:
        raise ValueError(
            "insert_hint: prompt_ids have no token boundary where the hint goes "
            f"(placement {config.placement!r})"
        )
    return ids, ids[:k] + ins + ids[k:], (k, k + len(ins))


@dataclasses.dataclass
class DistillExample:
    """One response y with its student and teacher prompts (int id lists).

    `task` groups examples in the token-weighted task loss (one task attempt:
    every example of a trace shares the trace key); `hint_span` is the
    inserted run [start, end) in teacher_prompt. `response_mask` (None: all
    1) is 1 on the response tokens that are trained and 0 on context inside
    the response (the tool results between the turns of a merged episode).
    `weight` multiplies the example's loss (the batch's `loss_weight`); it
    does not change the token counts that normalise it. `agent` is the
    episode's label. `temperature` / `top_k` / `top_p`: the sampling
    parameters `response_logprobs` were recorded under (the log-probs of the
    distribution sampled from; temperature 0 = greedy, raw log-probs;
    temperature None = not recorded; top_k <= 0 / top_p >= 1 = off).
    DistillLoss(kind="sampled") scores the response at them, weights it by
    the truncated importance ratio against `response_logprobs` (an older
    policy's draw), refuses greedy examples, and takes an example that
    records no parameters as drawn at the loss temperature by the current
    student (its log-probs, without parameters, are then not used).
    `response_spans`: [start, end) of each model response (one request's
    output) inside `response`, in order (None: the whole response is one);
    RMSD's top-T budget is per model response. `constraint`: the grammar the
    response was sampled under (`Completion.constraint`; None: unconstrained):
    its `response_logprobs` are under the grammar's mask, so
    DistillLoss(kind="sampled") leaves it out (counted `skipped/constrained`).
    """

    student_prompt: list[int]
    teacher_prompt: list[int]
    response: list[int]
    hint: str
    task: str
    hint_span: tuple[int, int] | None = None
    response_logprobs: list[float] | None = None
    weight: float = 1.0
    messages: list[dict] | None = None
    response_mask: list[float] | None = None
    agent: str | None = None
    temperature: float | None = None
    top_k: int = 0
    top_p: float = 1.0
    response_spans: list[tuple[int, int]] | None = None
    constraint: str | None = None

    def __post_init__(self):
        if not self.response:
            raise ValueError(f"DistillExample({self.task!r}): the response is empty")
        if not self.student_prompt or not self.teacher_prompt:
            raise ValueError(f"DistillExample({self.task!r}): prompts must be non-empty")
        if self.response_logprobs is not None and len(self.response_logprobs) != len(self.response):
            raise ValueError(
                f"DistillExample({self.task!r}): {len(self.response_logprobs)} "
                f"response_logprobs for {len(self.response)} response tokens"
            )
        if self.response_mask is not None and (
            len(self.response_mask) != len(self.response) or not sum(self.response_mask) > 0
        ):
            raise ValueError(
                f"DistillExample({self.task!r}): response_mask needs one entry per "
                f"response token ({len(self.response)}) and at least one > 0"
            )
        if self.response_spans is not None:
            self._check_spans()
        if not self.weight >= 0:
            raise ValueError(
                f"DistillExample({self.task!r}): weight must be >= 0, got {self.weight}"
            )

    def _check_spans(self):
        spans, n = self.response_spans or [], len(self.response)
        inside = np.zeros(n, bool)
        last = 0
        for a, b in spans:
            if not last <= a < b <= n:
                raise ValueError(
                    f"DistillExample({self.task!r}): response_spans must be ordered, "
                    f"disjoint, non-empty [start, end) spans inside the {n} response "
                    f"tokens, got {spans}"
                )
            inside[a:b], last = True, b
        if not spans or (self.trained_mask()[~inside] > 0).any():
            raise ValueError(
                f"DistillExample({self.task!r}): every trained response token must lie "
                f"in one of response_spans {spans}"
            )

    def trained_mask(self) -> np.ndarray:
        """[len(response)] float32: 1 where a response token is trained (the count)."""
        if self.response_mask is None:
            return np.ones(len(self.response), np.float32)
        return np.asarray(self.response_mask, np.float32)

    @property
    def num_trained(self) -> int:
        return int(self.trained_mask().sum())


def make_example(
    tokenizer,
    messages: Sequence[dict],
    response: Sequence[int],
    hint: str,
    task: str,
    config: HintConfig = HintConfig(),
    **kwargs,
) -> DistillExample:
    """A DistillExample for a chat prompt (`messages`) and a response's ids."""
    student, teacher, span = insert_hint(tokenizer, messages, hint, config)
    return DistillExample(
        student,
        teacher,
        [int(t) for t in response],
        hint,
        task,
        hint_span=span,
        messages=[dict(m) for m in messages],
        **kwargs,
    )


@dataclasses.dataclass
class PairedBatch:
    """Student and teacher PackedBatches with one layout ([R, L] each).

    teacher_index [R, L] int32: the teacher column whose prediction is scored
    against the same target as student column p (0 where student loss_mask is
    0). spans[i] = (row, student column of response token 0, teacher column
    of it, response length) for examples[i], the examples as packed (those
    `fit_examples` kept, cut ones shorter). response_ids [R, L] int32: which
    model response (`DistillExample.response_spans`, numbered 1.. over the
    batch) each student column predicts a token of, 0 elsewhere: RMSD ranks
    within these groups, so its top-T budget is per response whatever the
    packing. counts: `fit_examples`' counters (`TOO_LONG`).
    """

    student: PackedBatch
    teacher: PackedBatch
    teacher_index: np.ndarray
    spans: list[tuple[int, int, int, int]]
    examples: list[DistillExample]
    response_ids: np.ndarray
    counts: dict[str, int] = dataclasses.field(default_factory=dict)

    def gather_response(self, arr: np.ndarray, i: int) -> np.ndarray:
        """Example i's response slice [n, ...] of a student-aligned array [R, L, ...]."""
        r, c, _, n = self.spans[i]
        return np.asarray(arr)[r, c : c + n]


def _segment(e: DistillExample, prompt: Sequence[int]) -> Segment:
    """prompt ++ response as a Segment: loss on the trained response tokens, the
    example's log-probs and sampling parameters on them (1 / 0 / 1 elsewhere), and
    the `SAMPLING_RECORDED` / `LOGPROBS_RECORDED` flags."""
    p, n = len(prompt), len(prompt) + len(e.response)
    resp = slice(p, n)
    mask, lps = np.zeros(n, np.float32), np.zeros(n, np.float32)
    mask[resp] = e.trained_mask()  # a count; the weight multiplies the loss
    sampling, logprobs = np.zeros(n, np.float32), np.zeros(n, np.float32)
    if e.response_logprobs is not None:
        lps[resp] = e.response_logprobs
    if e.temperature is not None:
        sampling[resp] = 1.0
        if e.response_logprobs is not None:  # log-probs of a known distribution
            logprobs[resp] = 1.0
    params = {
        "temperature": np.ones(n, np.float32),
        "top_k": np.zeros(n, np.int32),
        "top_p": np.ones(n, np.float32),
    }
    if e.temperature is not None:
        for k in params:
            params[k][resp] = getattr(e, k)
    return Segment(
        np.asarray(list(prompt) + list(e.response), np.int32),
        mask,
        features={
            SAMPLER_LOGPROBS: lps,
            SAMPLING_RECORDED: sampling,
            LOGPROBS_RECORDED: logprobs,
        },
        task=e.task,
        weight=e.weight,
        temperature=params["temperature"],
        top_k=params["top_k"],
        top_p=params["top_p"],
    )


# What `fit_examples` counts: examples skipped whole, examples whose response end was
# cut, and the trained tokens (loss-mask count) the two left out.
TOO_LONG = ("skipped/too_long", "cut/too_long", "too_long_tokens")


def fit_examples(
    examples: Sequence[DistillExample], seq_len: int
) -> tuple[list[DistillExample], dict[str, int]]:
    """(the examples that fit `seq_len` tokens, counts of `TOO_LONG`).

    An example fits when its longer prompt (student or teacher) plus its
    response does. One that does not has its response's end cut to fit (its
    log-probs and mask with it; counted `cut/too_long`) while a trained token
    is left; otherwise (the prompt alone fills seq_len, or only untrained
    context fits) it is skipped (`skipped/too_long`). `too_long_tokens` counts
    the trained tokens left out either way. The input examples are not changed.
    """
    counts = dict.fromkeys(TOO_LONG, 0)
    out = []
    for e in examples:
        room = seq_len - max(len(e.student_prompt), len(e.teacher_prompt))
        if len(e.response) <= room:
            out.append(e)
            continue
        trained = e.trained_mask()
        kept = float(trained[: max(room, 0)].sum())
        counts["too_long_tokens"] += int(round(float(trained.sum()) - kept))
        if kept <= 0:
            counts["skipped/too_long"] += 1
            continue
        counts["cut/too_long"] += 1
        out.append(
            dataclasses.replace(
                e,
                response=e.response[:room],
                response_logprobs=None
                if e.response_logprobs is None
                else e.response_logprobs[:room],
                response_mask=None if e.response_mask is None else e.response_mask[:room],
                response_spans=None
                if e.response_spans is None
                else [(a, min(b, room)) for a, b in e.response_spans if a < room],
            )
        )
    return out, counts


def pack_pairs(
    examples: Sequence[DistillExample],
    seq_len: int,
    *,
    min_rows: int = 0,
    rows_multiple: int = 1,
    min_capacity: int = 0,
) -> PairedBatch:
    """Packs examples into aligned student and teacher rows of `seq_len` tokens.

    Example i is segment i of both batches, in the same row (the segments
    packer's first-fit-decreasing rows over the longer of its two
    sequences); its response predictions sit at student columns c..c+n-1 and
    teacher columns c'..c'+n-1. loss_mask is the example's `trained_mask`
    there (a count), loss_weight its `weight`; `response_ids` numbers its
    model responses. A pair longer than seq_len is
    cut to fit or skipped, and counted (`fit_examples`; `PairedBatch.counts`);
    when none fits the batch is padding only (nothing trains). The static task
    / segment capacities are at least `min_capacity`, so batches with up to
    that many examples share one compiled step.
    """
    if not examples:
        raise ValueError("pack_pairs: no examples")
    examples, counts = fit_examples(examples, seq_len)
    lengths = [
        max(len(e.student_prompt), len(e.teacher_prompt)) + len(e.response) for e in examples
    ]
    tasks = {name: j for j, name in enumerate(sorted({e.task for e in examples}))}
    bins = pack_rows(lengths, seq_len)
    n_rows = pad_rows(len(bins), min_rows, rows_multiple)
    features = {
        k: np.dtype(np.float32) for k in (SAMPLER_LOGPROBS, SAMPLING_RECORDED, LOGPROBS_RECORDED)
    }
    stu, tea = empty_batch(n_rows, seq_len, features), empty_batch(n_rows, seq_len, features)
    index = np.zeros((n_rows, seq_len), np.int32)
    response_ids = np.zeros((n_rows, seq_len), np.int32)
    next_id = 1
    spans: list = [None] * len(examples)
    for r, members in enumerate(bins):
        s0 = t0 = 0
        for seg_id, i in enumerate(members, start=1):
            e = examples[i]
            for out, prompt, start in ((stu, e.student_prompt, s0), (tea, e.teacher_prompt, t0)):
                seg = _segment(e, prompt)
                write_segment(out, r, start, seg, len(seg), tasks[e.task], seg_id, i)
            n = len(e.response)
            cs, ct = s0 + len(e.student_prompt) - 1, t0 + len(e.teacher_prompt) - 1
            index[r, cs : cs + n] = np.where(e.trained_mask() > 0, np.arange(ct, ct + n), 0)
            spans[i] = (r, cs, ct, n)
            for a, b in e.response_spans or [(0, n)]:
                response_ids[r, cs + a : cs + b] = next_id
                next_id += 1
            s0 += len(e.student_prompt) + n
            t0 += len(e.teacher_prompt) + n
    kw: dict[str, Any] = dict(
        num_tasks=pow2_bucket(max(len(tasks), min_capacity, 1)),
        num_segments=pow2_bucket(max(len(examples), min_capacity, 1)),
    )
    return PairedBatch(
        PackedBatch(**{**stu, **kw}),
        PackedBatch(**{**tea, **kw}),
        index,
        spans,
        list(examples),
        response_ids,
        counts,
    )


def sft_segments(examples: Sequence[DistillExample]) -> list[Segment]:
    """Student prompt ++ response, loss on the trained response tokens (SFT baseline)."""
    segs = []
    for e in examples:
        toks = list(e.student_prompt) + list(e.response)
        mask = [0.0] * len(e.student_prompt) + e.trained_mask().tolist()
        segs.append(
            Segment(
                np.asarray(toks, np.int32),
                np.asarray(mask, np.float32),
                task=e.task,
                weight=e.weight,
            )
        )
    return segs
