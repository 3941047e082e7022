"""Self-distillation training: OPSD, RMSD and the SFT-on-hinted-outputs baseline.

One update on a list of `DistillExample`s (see `distill_data`):

1. `pack_pairs` lays student (prompt ++ y) and teacher (prompt + hint ++ y)
   sequences out with the same rows and segments; the step gets the teacher
   rows and `teacher_index` as extras (`teacher_extras`, [R, L] int each).
2. RMSD only: a jitted pass (`relevance_scores`) gives the per-position
   divergence and the teacher's argmax; the candidates (top-T per model
   response, `PairedBatch.response_ids`, and/or >= threshold) go to the
   judge, and the batch's loss_mask becomes `relevance_mask` (candidates ∩
   selections).
3. `make_train_step(DistillLoss)` takes the step. Inside it the teacher runs
   on its rows (gradient stopped), its hidden states are gathered at the
   response positions into the student layout [R, L, D], and `distill_loss`
   is taken per position (chunk by chunk with `chunk_size`: no [R, L, V]
   logits anywhere; see `distill.loss`), token-weighted over the kept
   positions (task_mean by default: all examples of one trace are one task),
   times each example's `weight` (the batch's `loss_weight`; it never changes
   the normalising counts).

Teacher: the hinted self-teacher with weights "live" (the current params,
gradient stopped), "fixed" (a copy of the initial params) or "ema" (updated
after every step: `ema <- decay * ema + (1 - decay) * params`); or a teacher
model (`DistillConfig.teacher` names it: an HF directory or a model preset,
loaded by the caller as a `TeacherModel` of the student's vocabulary, frozen;
on-policy distillation from another model). Frozen ones reach the step as its
`teacher` argument; a teacher model runs there with its own graphdef.
Method "sft" instead trains the student (no hint) on the examples'
responses with plain SFT: the baseline with teacher-sampled responses.

The loop is the shared `Trainer`: with a workdir every update is logged
(train/...) and checkpointed every `checkpoint_every` updates together with
the fixed/EMA teacher params, and `restore()` resumes exactly.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ac2_jax.envs.judges import Judge, JudgeExample
from ac2_jax.losses import candidate_mask, ranked_positions
from ac2_jax.losses.relevance import judged
from ac2_jax.segments import pack_segments
from ac2_jax.segments.batch import pow2_bucket
from ac2_jax.training.core.objectives import LossFn, SFTLoss
from ac2_jax.training.core.sharding import batch_ways
from ac2_jax.training.core.train_step import TrainStep, make_train_step
from ac2_jax.training.core.trainer import Trainer, TrainerHooks
from ac2_jax.training.distill.data import (
    TOO_LONG,
    DistillExample,
    PairedBatch,
    fit_examples,
    pack_pairs,
    sft_segments,
)
from ac2_jax.training.distill.loss import (  # noqa: F401 (re-exported)
    SAMPLED_COUNTS,
    DistillLoss,
    divergence,
    relevance_scores,
    teacher_extras,
    teacher_logits,
)
from ac2_jax.training.distill.teacher import TeacherModel, tokenizer_fingerprint

METHODS = ("opsd", "rmsd", "sft")
TEACHERS = ("live", "fixed", "ema")  # the self-teacher's weights; anything else names a model
# Every step's counts (`SelfDistiller.update` metrics, `last_counts`): what did not fit
# seq_len (`data.TOO_LONG`) and what kind "sampled" left out or scored blind.
STEP_COUNTS = TOO_LONG + SAMPLED_COUNTS


@jax.jit
def _ema(ema, params, decay):
    return jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, ema, params)


# RMSD's candidates (`candidate_mask`: top-T per group and/or >= threshold) as one
# program per batch shape; eagerly it is ~20 small ops, each compiled per shape.
# Values equal the eager function's exactly (integer ranks and comparisons).
rmsd_candidates = jax.jit(candidate_mask, static_argnames=("top_t", "threshold"))


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Method and loss knobs. top_t / threshold pick RMSD candidates (top_t per model
    response: each request's output span, however the examples were merged).

    Batches are packed into at least `rows` rows of `seq_len`; `groups` is the
    least static task/segment capacity (batches of up to that many examples
    reuse one compiled step). skip_empty: no optimizer step when RMSD keeps
    no position (zero gradient, but Adam's moments would still move params).
    checkpoint_every: updates between checkpoints when run with a workdir
    (0: only explicit `save()`); keep_checkpoints: newest kept (None: all).
    chunk_size: positions per chunk of the loss's logits (`DistillLoss`;
    None: dense [R, L, V] logits; "auto": by the batch's shape).
    temperature: the full-vocabulary kinds' (and kl's) temperature; kind
    "sampled" scores each token at its recorded sampling parameters instead
    (the temperature for examples that record none) and weights an older
    policy's tokens by min(importance ratio, tis_cap) (None: untruncated).

    teacher: the self-teacher (the student's weights with the hint in its
    prompt): "live" (default), "fixed" or "ema"; or a teacher model: an HF
    directory or a model preset name (`recipes.MODELS`) of the student's
    vocabulary, loaded once and frozen (`TeacherModel`; the distill recipe loads
    it, `SelfDistiller(teacher_model=)` takes it loaded). It scores the same
    response tokens in its own prompt (the student's, with the hint if the
    example has one). teacher_dtype: a teacher model's weight storage, None (as
    loaded) or "bfloat16" / "float32".
    """

    method: str = "opsd"
    kind: str = "reverse_kl"
    beta: float = 0.5
    top_k: int | None = None
    temperature: float = 1.0
    mode: str = "task_mean"
    teacher: str = "live"
    ema_decay: float = 0.99
    teacher_dtype: str | None = None
    top_t: int | None = 4
    threshold: float | None = None
    seq_len: int = 256
    rows: int = 1
    groups: int = 8
    skip_empty: bool = True
    checkpoint_every: int = 0
    keep_checkpoints: int | None = 3
    chunk_size: int | str | None = "auto"
    tis_cap: float | None = 2.0

    def __post_init__(self):
        if self.checkpoint_every < 0:
            raise ValueError(
                f"DistillConfig.checkpoint_every must be >= 0, got {self.checkpoint_every}"
            )
        if self.method not in METHODS:
            raise ValueError(f"DistillConfig.method must be one of {METHODS}, got {self.method!r}")
        if not isinstance(self.teacher, str) or not self.teacher:
            raise ValueError(
                f"DistillConfig.teacher must be one of {TEACHERS} (the self-teacher) or a "
                f"teacher model (an HF directory or a model preset), got {self.teacher!r}"
            )
        close = difflib.get_close_matches(self.teacher, TEACHERS, n=1, cutoff=0.75)
        if self.teacher_is_model and close and not os.path.isdir(self.teacher):
            raise ValueError(
                f"DistillConfig.teacher {self.teacher!r}: not a self-teacher mode "
                f"{TEACHERS} nor a directory; did you mean {close[0]!r}?"
            )
        if self.teacher_is_model and self.method == "sft":
            raise ValueError(
                f"DistillConfig: method 'sft' trains on the responses alone; a teacher "
                f"model ({self.teacher!r}) needs method 'opsd' or 'rmsd'"
            )
        if self.teacher_dtype is not None and (
            not self.teacher_is_model or self.teacher_dtype not in ("float32", "bfloat16")
        ):
            raise ValueError(
                "DistillConfig.teacher_dtype is a teacher model's weight dtype: None, "
                f"'float32' or 'bfloat16', with teacher naming a model; got "
                f"{self.teacher_dtype!r} with teacher {self.teacher!r}"
            )
        if not 0.0 <= self.ema_decay <= 1.0:
            raise ValueError(f"DistillConfig.ema_decay must be in [0, 1], got {self.ema_decay}")
        self.loss()

    @property
    def teacher_is_model(self) -> bool:
        """Whether `teacher` names a teacher model (not a self-teacher mode)."""
        return self.teacher not in TEACHERS

    def loss(self) -> DistillLoss:
        return DistillLoss(
            self.kind,
            self.beta,
            self.top_k,
            self.temperature,
            self.mode,
            chunk_size=self.chunk_size,
            tis_cap=self.tis_cap,
        )


@dataclasses.dataclass
class Relevance:
    """What RMSD kept in one update, per example (response positions)."""

    divergence: list[np.ndarray]
    candidates: list[list[int]]
    selected: list[list[int]]
    teacher_argmax: list[np.ndarray]


def _check_teacher(config: DistillConfig, teacher_model, graphdef, state, tokenizer) -> None:
    """A teacher model is given exactly when the config names one, with the student's
    tokenizer (`tokenizer=`): the teacher's recorded tokenizer fingerprint must be the
    student's tokenizer's, and both logits widths at least the tokenizer's size
    (they may differ by padding rows: `teacher`'s module docstring). One line naming
    what differs otherwise."""
    if config.teacher_is_model and teacher_model is None:
        raise ValueError(
            f"SelfDistiller: DistillConfig.teacher={config.teacher!r} names a teacher model; "
            "pass it loaded as teacher_model=TeacherModel.from_model(model, tokenizer) (the "
            "distill recipe loads it)"
        )
    if not config.teacher_is_model and teacher_model is not None:
        raise ValueError(
            f"SelfDistiller: teacher_model given but DistillConfig.teacher={config.teacher!r} "
            "is the self-teacher; set teacher to the model's spec"
        )
    if teacher_model is not None:
        if not isinstance(teacher_model, TeacherModel):
            raise TypeError(
                "SelfDistiller: teacher_model must be a TeacherModel "
                f"(TeacherModel.from_model(model, tokenizer)), got {type(teacher_model).__name__}"
            )
        if tokenizer is None:
            raise ValueError(
                f"SelfDistiller: teacher model {config.teacher!r} needs the student's "
                "tokenizer (tokenizer=...): the teacher must share it, token id by id"
            )
        if teacher_model.vocab != tokenizer_fingerprint(tokenizer):
            raise ValueError(
                f"distill.teacher {config.teacher!r}: vocabulary mismatch (the teacher's "
                "tokenizer is not the student's: its token table's fingerprint differs; "
                "check_vocabulary(student_tokenizer, teacher_tokenizer, ...) names what "
                "differs); a teacher model must share the student's tokenizer, token id by id"
            )
        student = int(nnx.merge(graphdef, state.params, state.rest).config.vocab_size)
        if student < teacher_model.tokenizer_size:
            raise ValueError(
                f"distill.teacher {config.teacher!r}: vocabulary mismatch (the student's "
                f"logits width (vocab_size {student}) is below the tokenizer's "
                f"{teacher_model.tokenizer_size} ids)"
            )


def _check_no_padding_ids(examples: Sequence[DistillExample], teacher) -> None:
    """With a teacher model: refuses (one line) a response token id >= the tokenizer's
    size, a padding row of the heads that no token has (outside the ids the
    divergence is taken over when the widths differ)."""
    if not isinstance(teacher, TeacherModel):
        return
    n = teacher.tokenizer_size
    for i, e in enumerate(examples):
        bad = [t for t in e.response if t >= n or t < 0]
        if bad:
            raise ValueError(
                f"SelfDistiller: example {i} ({e.task!r}) holds response token id {bad[0]}, "
                f"outside the tokenizer's {n} ids (a padding row of the logits, no token); "
                "sample the student with its tokenizer's ids only"
            )


class SelfDistiller(TrainerHooks):
    """Holds the `Trainer` and the teacher; `update(examples)` takes one step.

    graphdef/state from `create_train_state`. judge: needed for method
    "rmsd" (with a tokenizer to show it text). The step (one device
    unless a mesh is given) runs the teacher forward itself
    (frozen teacher params go in as the step's `teacher`). Pass an earlier
    distiller's `step_fn` (same loss and optimizer) to reuse its compiled step, e.g. across seeds.
    workdir: checkpoints (`config.checkpoint_every`) and train/ metrics
    (`logger`, a MetricsLogger, replaces its workdir/metrics sink);
    `restore()` loads the latest and returns the number of updates done.
    teacher_model: the loaded `TeacherModel` when `config.teacher` names a model
    (required then, refused otherwise), with `tokenizer` (the student's, then
    required): the teacher's recorded tokenizer must be it; the logits widths may
    differ by padding rows (ids >= the tokenizer's size), and `update` refuses a
    response holding such an id (`teacher`'s module docstring).
    It is not checkpointed (a resumed run loads it again from its spec).
    """

    def __init__(
        self,
        graphdef,
        state,
        config: DistillConfig,
        optimizer,
        *,
        judge: Judge | None = None,
        tokenizer=None,
        mesh=None,
        donate: bool = True,
        step_fn: TrainStep | None = None,
        workdir: str | os.PathLike | None = None,
        make_step: Callable[..., TrainStep] = make_train_step,
        progress: bool = False,
        total_steps: int | None = None,
        logger=None,
        teacher_model: TeacherModel | None = None,
    ):
        _check_teacher(config, teacher_model, graphdef, state, tokenizer)
        if config.method == "rmsd" and (judge is None or tokenizer is None):
            raise ValueError("SelfDistiller: method 'rmsd' needs a judge and a tokenizer")
        if config.checkpoint_every and workdir is None:
            raise ValueError(
                f"SelfDistiller: DistillConfig.checkpoint_every="
                f"{config.checkpoint_every} needs a workdir"
            )
        self.graphdef, self.config, self.judge, self.tokenizer = graphdef, config, judge, tokenizer
        loss: LossFn = SFTLoss(mode=config.mode) if config.method == "sft" else config.loss()
        if step_fn is not None and step_fn.loss_fn != loss:
            raise ValueError(
                f"SelfDistiller: step_fn has loss {step_fn.loss_fn}; this config needs {loss}"
            )
        self.trainer = Trainer(
            graphdef,
            state,
            loss,
            optimizer,
            workdir=workdir,
            checkpoint_every=config.checkpoint_every,
            keep_checkpoints=config.keep_checkpoints,
            hooks=self,
            mesh=mesh,
            donate=donate,
            step_fn=step_fn,
            make_step=make_step,
            progress=progress,
            total_steps=total_steps,
            logger=logger,
        )
        # A copy (new buffers, same placement as the state) survives the step's donation.
        self.teacher_params = (
            teacher_model
            if config.teacher_is_model
            else jax.tree.map(jnp.copy, self.state.params)
            if config.teacher != "live"
            else None
        )
        self.last_relevance: Relevance | None = None
        self.last_counts: dict[str, int] = dict.fromkeys(STEP_COUNTS, 0)
        self.last_examples: list[DistillExample] = []

    @property
    def state(self):
        return self.trainer.state

    @property
    def step_fn(self) -> TrainStep:
        """The compiled step: pass it to a later distiller to reuse it."""
        return self.trainer.step_fn

    # -- checkpoints (TrainerHooks)

    def state_dict(self) -> dict:
        return {"method": self.config.method, "teacher": self.config.teacher}

    def load_state_dict(self, data: dict) -> None:
        mine = self.state_dict()
        if data != mine:
            raise ValueError(
                f"SelfDistiller: the checkpoint was trained with {data}, this distiller is {mine}"
            )

    def extra_state(self):
        if self.teacher_params is None or self.config.teacher_is_model:
            return None  # a teacher model is loaded again from its spec, never saved
        return {"teacher_params": self.teacher_params}

    def load_extra_state(self, tree) -> None:
        self.teacher_params = tree["teacher_params"]

    def restore(self) -> int:
        """Loads the workdir's latest checkpoint (state and teacher); returns the number
        of `update` calls it holds (0: none)."""
        return self.trainer.restore()

    def save(self) -> bool:
        return self.trainer.save()

    def close(self) -> None:
        """Waits for pending checkpoints; closes the metrics files."""
        self.trainer.close()

    # -- teacher

    def current_teacher_params(self):
        return self.state.params if self.config.teacher == "live" else self.teacher_params

    def teacher_logits(self, paired: PairedBatch) -> jax.Array:
        """Dense teacher logits [R, L, V] in the student layout (diagnostics only)."""
        t = self.current_teacher_params()
        if isinstance(t, TeacherModel):
            return teacher_logits(
                t.graphdef, t.params, t.rest, paired.teacher, paired.teacher_index
            )
        return teacher_logits(
            self.graphdef, t, self.state.rest, paired.teacher, paired.teacher_index
        )

    # -- RMSD

    def _judge_mask(self, paired: PairedBatch, div, cand, tmax) -> tuple[np.ndarray, Relevance]:
        div, cand, tmax = np.asarray(div), np.asarray(cand), np.asarray(tmax)
        jm = np.zeros(div.shape, np.float32)
        rel = Relevance([], [], [], [])
        tok = self.tokenizer
        for i, e in enumerate(paired.examples):
            r, c, _, n = paired.spans[i]
            d, cm, tm = div[r, c : c + n], cand[r, c : c + n], tmax[r, c : c + n]
            ranked = ranked_positions(cm, d)
            picked = []
            if ranked:
                ex = JudgeExample(
                    prompt=tok.decode(e.student_prompt),
                    response=tok.decode(e.response),
                    response_tokens=tuple(tok.decode([t]) for t in e.response),
                    hint=e.hint,
                    candidates=tuple(ranked),
                    teacher_tokens=tuple(tok.decode([int(t)]) for t in tm),
                )
                assert self.judge is not None  # __init__ requires one for "rmsd"
                picked = [p for p in self.judge.select(ex) if p in set(ranked)]
            jm[r, [c + p for p in picked]] = 1.0
            rel.divergence.append(d)
            rel.candidates.append(ranked)
            rel.selected.append(picked)
            rel.teacher_argmax.append(tm)
        return jm, rel

    def relevance(self, paired: PairedBatch) -> tuple[np.ndarray, Relevance]:
        """(kept mask [R, L], per-example details) at the current student params."""
        cfg, b = self.config, paired.student
        div, tmax = relevance_scores(
            self.graphdef,
            self.state.params,
            self.teacher_params,
            self.state.rest,
            b,
            teacher_extras(paired),
            cfg.loss(),
        )
        # top-T per model response (not per packed segment: a merged episode holds
        # several), so merged and split layouts keep the same positions.
        mask, groups = jnp.asarray(b.loss_mask), jnp.asarray(paired.response_ids)
        cand = rmsd_candidates(div, mask, cfg.top_t, cfg.threshold, groups)
        jm, rel = self._judge_mask(paired, div, cand, tmax)
        return np.asarray(judged(cand, jnp.asarray(jm))), rel  # relevance_mask's, from cand

    # -- one update

    def prepare(self, examples: Sequence[DistillExample]):
        """(batch, extras) for the step: extras `teacher_extras(paired)`; None for "sft".

        Examples longer than `seq_len` are cut to fit or skipped (`fit_examples`);
        `last_counts` holds the counts (`STEP_COUNTS`) and `last_examples` what was
        packed. Kind "sampled" refuses greedy examples (`DistillLoss.check_examples`),
        leaves out grammar-constrained ones (`skipped/constrained`) and counts those
        that record no sampling parameters (`unrecorded_sampling`, `_tokens`)."""
        cfg = self.config
        counts = dict.fromkeys(STEP_COUNTS, 0)
        if cfg.method != "sft":
            examples, skipped = cfg.loss().usable_examples(examples)
            counts.update(skipped)
        examples, too_long = fit_examples(examples, cfg.seq_len)
        counts.update(too_long)
        if cfg.method != "sft":
            counts.update(cfg.loss().unrecorded_sampling(examples))
        self.last_counts = counts
        self.last_examples = examples
        self.last_relevance = None
        if not examples:  # all too long: nothing to pack, nothing trains
            return None, None
        # Rows grow past cfg.rows to what the examples need, in steps the step's mesh
        # splits (batch rows over data x fsdp, times grad_accum), never to an odd count.
        step = self.trainer.step_fn
        multiple = batch_ways(step.mesh) * step.grad_accum
        if cfg.method == "sft":
            b = pack_segments(
                sft_segments(examples), cfg.seq_len, min_rows=cfg.rows, rows_multiple=multiple
            )
            cap = pow2_bucket(cfg.groups)
            return dataclasses.replace(
                b, num_tasks=max(b.num_tasks, cap), num_segments=max(b.num_segments, cap)
            ), None
        paired = pack_pairs(
            examples, cfg.seq_len, min_rows=cfg.rows, rows_multiple=multiple,
            min_capacity=cfg.groups,
        )  # fmt: skip
        batch = paired.student
        if cfg.method == "rmsd":
            kept, self.last_relevance = self.relevance(paired)
            batch = dataclasses.replace(batch, loss_mask=kept)
        return batch, teacher_extras(paired)

    def update(self, examples: Sequence[DistillExample]) -> dict[str, float]:
        """One optimizer step on `examples` (skipped when no position is kept).

        Every call is one loop step of the Trainer (skipped ones too): logged,
        counted and checkpointed on the cadence. The metrics count (`STEP_COUNTS`)
        what did not fit `seq_len` (`skipped/too_long`, `cut/too_long`,
        `too_long_tokens`) and, for kind "sampled", the grammar-constrained
        examples left out (`skipped/constrained`) and the examples scored without
        recorded sampling parameters (`unrecorded_sampling`, `_tokens`)."""
        out: dict[str, float] = {"skipped": 1.0, "kept_tokens": 0.0}
        _check_no_padding_ids(examples, self.teacher_params)
        counts: dict[str, int] = dict.fromkeys(STEP_COUNTS, 0)
        if examples:
            batch, extras = self.prepare(examples)
            counts = self.last_counts
            kept = 0.0 if batch is None else float(np.asarray(batch.loss_mask).astype(bool).sum())
            if batch is not None and (kept or not self.config.skip_empty):
                out = self.trainer.update(batch, extras, teacher=self.teacher_params)
                if self.config.teacher == "ema":
                    self.teacher_params = _ema(
                        self.teacher_params, self.state.params, jnp.float32(self.config.ema_decay)
                    )
                out.update(
                    skipped=0.0,
                    kept_tokens=kept,
                    response_tokens=float(sum(e.num_trained for e in self.last_examples)),
                )
        out.update({k: float(v) for k, v in counts.items()})
        self.trainer.end_step(out)
        return out
