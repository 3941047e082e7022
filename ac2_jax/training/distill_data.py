"""Self-distillation data: hint insertion, paired student/teacher batches, sources.

The student sees `prompt ++ y` (its own response y); the teacher sees the same
prompt with a hint inserted, then the same y. `insert_hint` builds the teacher
prompt ids as the student prompt ids with one contiguous run of tokens
inserted (placement "system", "before_turn" or "after_user"), so everything
but the hint is token-for-token what the student saw. `pack_pairs` packs
student and teacher sequences with the same row/segment layout and gives, for
every student column, the teacher column that predicts the same response
token (`teacher_index`); the response positions then line up exactly.

Data sources (each returns `DistillExample`s):
(a) `examples_from_traces`: stored traces + their hints (offline);
(b)/(c) `ac2_jax.training.distill_sources`: resample a turn with the current
policy, or roll out, grade and distill the failures with generated hints.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ac2_jax.segments import PackedBatch, Segment
from ac2_jax.segments.packing import capacity, empty_batch, pad_rows
from ac2_jax.trace.types import Trace

HINT_PLACEMENTS = ("system", "before_turn", "after_user")


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
            raise ValueError(f"HintConfig.placement must be one of {HINT_PLACEMENTS}, "
                             f"got {self.placement!r}")
        if "{hint}" not in self.template:
            raise ValueError(f"HintConfig.template must contain '{{hint}}', got {self.template!r}")

    def text(self, hint: str) -> str:
        return self.template.replace("{hint}", hint)


def hinted_messages(messages: Sequence[dict], hint: str, config: HintConfig = HintConfig()
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
    holds = [q for q in valid if text in tokenizer.decode(tt[q:q + n])] or valid
    return next((q for q in holds if tt[q] in special), holds[0])


def insert_hint(tokenizer, messages: Sequence[dict], hint: str,
                config: HintConfig = HintConfig(), prompt_ids: Sequence[int] | None = None
                ) -> tuple[list[int], list[int], tuple[int, int]]:
    """(student ids, teacher ids, (start, end)): teacher = student with ids inserted at start.

    Both prompts end with the generation prompt. `prompt_ids` (e.g. a stored
    completion's, possibly spliced) default to the template rendering of
    `messages`; they must decode to that rendering. Raises ValueError when the
    hint cannot enter as one contiguous token run.
    """
    student_text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
    teacher_text = tokenizer.apply_chat_template(hinted_messages(messages, hint, config),
                                                 add_generation_prompt=True)
    canon, tt = tokenizer.encode(student_text), tokenizer.encode(teacher_text)
    p = _common_prefix(canon, tt, min(len(canon), len(tt)))
    s = _common_prefix(canon[::-1], tt[::-1], min(len(canon), len(tt)) - p)
    if p + s != len(canon) or len(tt) <= len(canon):
        raise ValueError("insert_hint: the hint changes the tokenization of the surrounding "
                         f"context (placement {config.placement!r}); use another placement "
                         "or template")
    p = _pick_split(tokenizer, tt, p, len(tt) - len(canon), config.text(hint))
    ins = tt[p:p + len(tt) - len(canon)]
    if prompt_ids is None or list(prompt_ids) == canon:
        return list(canon), list(tt), (p, p + len(ins))
    ids = [int(t) for t in prompt_ids]
    if tokenizer.decode(ids) != student_text:
        raise ValueError("insert_hint: prompt_ids do not decode to the chat rendering of "
                         "messages; pass the messages of that request")
    chars = len(tokenizer.decode(canon[:p]))
    k = next((k for k in range(len(ids) + 1) if len(tokenizer.decode(ids[:k])) >= chars), None)
    if k is None or tokenizer.decode(ids[:k]) != student_text[:chars]:
        raise ValueError("insert_hint: prompt_ids have no token boundary where the hint goes")
    return ids, ids[:k] + ins + ids[k:], (k, k + len(ins))


@dataclasses.dataclass
class DistillExample:
    """One response y with its student and teacher prompts (int id lists).

    `task` groups examples in the token-weighted task loss (one task attempt);
    `hint_span` is the inserted run [start, end) in teacher_prompt.
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

    def __post_init__(self):
        if not self.response:
            raise ValueError(f"DistillExample({self.task!r}): the response is empty")
        if not self.student_prompt or not self.teacher_prompt:
            raise ValueError(f"DistillExample({self.task!r}): prompts must be non-empty")
        if self.response_logprobs is not None and len(self.response_logprobs) != len(self.response):
            raise ValueError(f"DistillExample({self.task!r}): {len(self.response_logprobs)} "
                             f"response_logprobs for {len(self.response)} response tokens")


def make_example(tokenizer, messages: Sequence[dict], response: Sequence[int], hint: str,
                 task: str, config: HintConfig = HintConfig(), **kwargs) -> DistillExample:
    """A DistillExample for a chat prompt (`messages`) and a response's ids."""
    student, teacher, span = insert_hint(tokenizer, messages, hint, config)
    return DistillExample(student, teacher, [int(t) for t in response], hint, task,
                          hint_span=span, messages=[dict(m) for m in messages], **kwargs)


@dataclasses.dataclass
class PairedBatch:
    """Student and teacher PackedBatches with one layout ([R, L] each).

    teacher_index [R, L] int32: the teacher column whose prediction is scored
    against the same target as student column p (0 where student loss_mask is
    0). spans[i] = (row, student column of response token 0, teacher column
    of it, response length) for examples[i].
    """

    student: PackedBatch
    teacher: PackedBatch
    teacher_index: np.ndarray
    spans: list[tuple[int, int, int, int]]
    examples: list[DistillExample]

    def gather_response(self, arr: np.ndarray, i: int) -> np.ndarray:
        """Example i's response slice [n, ...] of a student-aligned array [R, L, ...]."""
        r, c, _, n = self.spans[i]
        return np.asarray(arr)[r, c:c + n]


def _ffd(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows, free = [], []
    for i in order:
        r = next((r for r, f in enumerate(free) if lengths[i] <= f), None)
        if r is None:
            rows.append([i])
            free.append(seq_len - lengths[i])
        else:
            rows[r].append(i)
            free[r] -= lengths[i]
    return [sorted(r) for r in rows]


def _put(out, r, start, tokens, prompt_len, weight, task_id, seg_id, seg_index, logprobs):
    n = len(tokens)
    sl = slice(start, start + n)
    out["tokens"][r, sl] = tokens
    out["targets"][r, start:start + n - 1] = tokens[1:]
    out["positions"][r, sl] = np.arange(n)
    out["segment_ids"][r, sl] = seg_id
    out["loss_mask"][r, start + prompt_len - 1:start + n - 1] = weight
    if logprobs is not None:
        out["sampler_logprobs"][r, start + prompt_len - 1:start + n - 1] = logprobs
    out["task_ids"][r, sl] = task_id
    out["segment_index"][r, sl] = seg_index


def pack_pairs(examples: Sequence[DistillExample], seq_len: int, *, min_rows: int = 0,
               rows_multiple: int = 1, min_capacity: int = 0) -> PairedBatch:
    """Packs examples into aligned student and teacher rows of `seq_len` tokens.

    Example i is segment i of both batches, in the same row; its response
    predictions sit at student columns c..c+n-1 and teacher columns
    c'..c'+n-1. A pair longer than seq_len is an error. The static task /
    segment capacities are at least `min_capacity`, so batches with up to
    that many examples share one compiled step.
    """
    if not examples:
        raise ValueError("pack_pairs: no examples")
    lengths = []
    for i, e in enumerate(examples):
        n = max(len(e.student_prompt), len(e.teacher_prompt)) + len(e.response)
        if n > seq_len:
            raise ValueError(f"pack_pairs: example {i} ({e.task!r}) needs {n} tokens, more "
                             f"than seq_len={seq_len}")
        lengths.append(n)
    tasks = {name: j for j, name in enumerate(sorted({e.task for e in examples}))}
    bins = _ffd(lengths, seq_len)
    n_rows = pad_rows(len(bins), min_rows, rows_multiple)
    stu, tea = empty_batch(n_rows, seq_len), empty_batch(n_rows, seq_len)
    index = np.zeros((n_rows, seq_len), np.int32)
    spans: list = [None] * len(examples)
    for r, members in enumerate(bins):
        s0 = t0 = 0
        for seg_id, i in enumerate(members, start=1):
            e = examples[i]
            y = np.asarray(e.response, np.int32)
            lp = None if e.response_logprobs is None else np.asarray(e.response_logprobs)
            for out, prompt, start in ((stu, e.student_prompt, s0), (tea, e.teacher_prompt, t0)):
                toks = np.concatenate([np.asarray(prompt, np.int32), y])
                _put(out, r, start, toks, len(prompt), e.weight, tasks[e.task], seg_id, i, lp)
            cs, ct = s0 + len(e.student_prompt) - 1, t0 + len(e.teacher_prompt) - 1
            index[r, cs:cs + len(y)] = np.arange(ct, ct + len(y))
            spans[i] = (r, cs, ct, len(y))
            s0 += len(e.student_prompt) + len(y)
            t0 += len(e.teacher_prompt) + len(y)
    kw = dict(num_tasks=capacity(max(len(tasks), min_capacity)),
              num_segments=capacity(max(len(examples), min_capacity)))
    return PairedBatch(PackedBatch(**stu, **kw), PackedBatch(**tea, **kw), index, spans,
                       list(examples))


def sft_segments(examples: Sequence[DistillExample]) -> list[Segment]:
    """Student prompt ++ response, loss on the response (SFT on e.g. teacher samples)."""
    segs = []
    for e in examples:
        toks = list(e.student_prompt) + list(e.response)
        mask = [0.0] * len(e.student_prompt) + [1.0] * len(e.response)
        segs.append(Segment(toks, mask, np.zeros(len(toks)), task=e.task, weight=e.weight))
    return segs


def examples_from_traces(traces: Sequence[Trace], tokenizer, config: HintConfig = HintConfig(),
                         agent: str = "main", hint_join: str = "\n") -> list[DistillExample]:
    """(a) Offline: one example per hinted trace, from its `agent` episode's last completion.

    The student prompt is that completion's prompt_ids, the response its
    output_ids; the teacher prompt inserts the trace's hints (joined) into
    the request's messages (`Completion.messages`, recorded by the endpoint).
    Traces without hints are skipped.
    """
    out = []
    for tr in traces:
        if not tr.hints:
            continue
        eps = [ep for ep in tr.episodes if ep.agent == agent and ep.completions]
        if not eps:
            raise ValueError(f"examples_from_traces: trace {tr.key!r} has no {agent!r} completion")
        c = eps[-1].completions[-1]
        if c.messages is None:
            raise ValueError(f"examples_from_traces: trace {tr.key!r}: the last completion has no "
                             "messages (needed to place the hint)")
        if not c.output_ids:
            continue
        hint = hint_join.join(tr.hints)
        student, teacher, span = insert_hint(tokenizer, c.messages, hint, config, c.prompt_ids)
        out.append(DistillExample(student, teacher, list(c.output_ids), hint, tr.key,
                                  hint_span=span, response_logprobs=list(c.output_logprobs),
                                  messages=list(c.messages)))
    return out
