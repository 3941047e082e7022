"""The self-distillation loss and the teacher inside the train step.

`DistillLoss.from_model` (what the step calls) runs the teacher on the
teacher rows of `teacher_extras(paired)` with the live params (gradient
stopped) or the step's frozen `teacher` params, gathers its hidden states at
the response positions into the student layout [R, L, D] (`teacher_hidden`),
and takes `distill_loss` per position, densely or `chunk_size` positions at
a time (`ac2_jax.losses.chunked_logits_map`: no [R, L, V] logits). The host
never ships teacher logits. `relevance_scores` ranks positions for RMSD the
same way. kind="sampled" scores each response token at the sampling
parameters it was drawn with (`_sampling_inputs`) and weights an older
policy's token by the truncated importance ratio. `teacher_logits` /
`divergence` are the dense [R, L, V] references (diagnostics and tests).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ac2_jax.losses import (
    DIVERGENCES,
    MODES,
    chunked_logits_map,
    distill_loss,
    reverse_kl,
    sampled_token_advantage,
    sampled_token_loss,
    token_logprobs,
)
from ac2_jax.models.memory_plan import AUTO, logprob_chunk_for
from ac2_jax.segments.segments import SAMPLER_LOGPROBS
from ac2_jax.training.core.objectives import OBJECTIVES, Objective, StepModel
from ac2_jax.training.core.train_step import forward
from ac2_jax.training.distill.data import (
    LOGPROBS_RECORDED,
    SAMPLING_RECORDED,
    DistillExample,
    PairedBatch,
)
from ac2_jax.training.distill.teacher import TeacherModel

# What `DistillLoss.usable_examples` / `unrecorded_sampling` count per step (kind
# "sampled"; 0 for the others): grammar-constrained examples left out, and the
# examples / trained tokens that record no sampling parameters.
SAMPLED_COUNTS = ("skipped/constrained", "unrecorded_sampling", "unrecorded_sampling_tokens")
TEACHER_KEYS = ("teacher_tokens", "teacher_positions", "teacher_segment_ids", "teacher_index")


def teacher_extras(paired: PairedBatch) -> dict[str, np.ndarray]:
    """The step's extras for a paired batch: the teacher rows' tokens, positions and
    segment ids, and `teacher_index` ([R, L] int each, split with the batch rows)."""
    t = paired.teacher
    return {
        "teacher_tokens": t.tokens,
        "teacher_positions": t.positions,
        "teacher_segment_ids": t.segment_ids,
        "teacher_index": paired.teacher_index,
    }


def teacher_side(model: StepModel) -> StepModel:
    """The StepModel the teacher runs as (always with teacher=True): the step's own
    (the self-teacher: live params, or frozen ones of the same structure), or, when
    the step's teacher is a `TeacherModel`, one of its own graphdef and params."""
    t = model.teacher_params
    if isinstance(t, TeacherModel):
        return StepModel(t.graphdef, t.params, t.rest, t.params)
    return model


def teacher_hidden(model: StepModel, extras: dict) -> jax.Array:
    """Teacher hidden states [R, L, D_teacher] in the student layout (gradient
    stopped); D_teacher is the student's D unless the teacher is a `TeacherModel`."""
    missing = [k for k in TEACHER_KEYS if k not in (extras or {})]
    if missing:
        raise ValueError(
            f"DistillLoss needs extras with the teacher rows, missing {missing}; "
            "build them with teacher_extras(pack_pairs(...))"
        )
    h = teacher_side(model).hidden(
        extras["teacher_tokens"],
        extras["teacher_positions"],
        extras["teacher_segment_ids"],
        teacher=True,
    )
    index = extras["teacher_index"].astype(jnp.int32)
    return jax.lax.stop_gradient(jnp.take_along_axis(h, index[..., None], axis=1))


def _sampling_inputs(batch, temperature: float) -> dict:
    """Per-position sampling parameters kind "sampled" scores each token at: the
    recorded ones where the example recorded them (`SAMPLING_RECORDED`), else the
    loss temperature with top-k / top-p off; and the behaviour log-probs with the
    `LOGPROBS_RECORDED` flag (importance weights only where it is 1)."""
    need = (SAMPLING_RECORDED, LOGPROBS_RECORDED, SAMPLER_LOGPROBS)
    missing = [k for k in need if k not in batch.features]
    if missing:
        raise ValueError(
            f"DistillLoss(kind='sampled') needs the batch features {missing} (how each "
            "response was sampled); pack the examples with pack_pairs"
        )
    rec = jnp.asarray(batch.features[SAMPLING_RECORDED]) > 0
    return {
        "temperature": jnp.where(rec, batch.temperature, temperature).astype(jnp.float32),
        "top_k": jnp.where(rec, batch.top_k, 0).astype(jnp.int32),
        "top_p": jnp.where(rec, batch.top_p, 1.0).astype(jnp.float32),
        "sampler_logprobs": jnp.asarray(batch.features[SAMPLER_LOGPROBS], jnp.float32),
        "recorded": jnp.asarray(batch.features[LOGPROBS_RECORDED], jnp.float32),
    }


def _common_ids(logits):
    """Student / teacher logits cut to their first min(V_s, V_t) ids: the ids both
    heads have. Widths differ only by padding rows past the shared tokenizer's ids
    (`teacher`'s module docstring), so every token is kept and each side is
    renormalised over the same ids; equal widths are unchanged."""
    s, t = logits
    width = min(s.shape[-1], t.shape[-1])
    return s[..., :width], t[..., :width]


def _apply(fn, model: StepModel, student_hidden, teacher_h, per_token, chunk_size):
    """fn([student logits, teacher logits], per_token) densely or chunk by chunk
    ("auto": chunked when both sides' fp32 logits exceed `logprob_chunk_for`'s bound).
    The teacher's logits come from its own head (`teacher_side`)."""
    teacher = teacher_side(model)
    if chunk_size == AUTO:
        rows, length = student_hidden.shape[:2]
        chunk_size = logprob_chunk_for(2 * rows, length, model.head().vocab_size)
    if chunk_size is None:
        return fn(
            [model.project(student_hidden), teacher.project(teacher_h, teacher=True)], per_token
        )
    return chunked_logits_map(
        fn,
        [(student_hidden, model.head()), (teacher_h, teacher.head(teacher=True))],
        per_token,
        chunk_size=chunk_size,
    )


@dataclasses.dataclass(frozen=True)
class DistillLoss(Objective):
    """LossFn: `distill_loss(student logits, teacher logits, targets)` per position.

    An `Objective`: the objective registry holds one entry per divergence,
    "distill_<kind>" (`distill_objective`: this class with `kind` fixed), so a
    config section picks it as any other objective, e.g. {"kind": "distill_jsd",
    "beta": 0.3} is `DistillLoss(kind="jsd", beta=0.3)`'s twin.

    In the train step (`from_model`) the teacher runs inside it on the rows
    of `teacher_extras` (live: the params; or the step's `teacher` params),
    gradient stopped. chunk_size None: dense logits; an int: both sides are
    projected `chunk_size` positions at a time (same values, no [R, L, V]);
    "auto" (default): one of the two by the batch's shape (`models.memory_plan`).
    Called directly, `loss(logits, batch, extras)` takes
    `extras["teacher_logits"]` [R, L, V] aligned with the batch (the dense reference).

    kind="sampled" (the reverse-KL estimator on the sampled token) scores each
    token at the sampling parameters it was drawn with (the example's
    temperature / top_k / top_p, as RL re-scores its tokens; the loss
    `temperature` only for examples that record none) and weights a token by
    min(pi_s(y) / mu(y), tis_cap) against its recorded log-probs mu (no
    gradient; 1 for an on-policy token up to sampler/learner rounding, and
    where none are recorded), so E[grad] is that of KL(pi_s || p_t) at the
    recorded parameters, also for an older policy's responses. Greedy
    examples have no behaviour distribution: `check_examples` refuses them
    (SelfDistiller calls it). Examples sampled under a grammar
    (`DistillExample.constraint`) are left out and counted
    (`usable_examples`: `skipped/constrained`); examples that record no
    sampling parameters are counted (`unrecorded_sampling`). The full-vocabulary kinds are exact per
    position and use the loss `temperature`.

    Metrics: kl (reverse KL, student || teacher, full vocabulary, at the
    temperature the loss scores the position at: `temperature`, or for
    "sampled" its recorded one), kl_temperature (that temperature's token
    mean: the temperature kl is measured at), student_logp, teacher_logp of
    the targets (raw logits); for "sampled" also tis_weight (the mean
    importance weight) and, with a cap, tis_capped (the share of tokens at it).
    """

    kind: str = "reverse_kl"
    beta: float = 0.5
    top_k: int | None = None
    temperature: float = 1.0
    mode: str = "task_mean"
    normalizer: float | None = None
    chunk_size: int | str | None = AUTO
    tis_cap: float | None = 2.0

    @property
    def registered_name(self) -> str:
        """Its objective's name, "distill_<kind>" (`OBJECTIVES.name_of` reads it: a
        config holding `DistillLoss(kind=k)` writes as the objective `distill_objective(k)`)."""
        return f"distill_{self.kind}"

    def __post_init__(self):
        if self.kind not in DIVERGENCES:
            raise ValueError(
                f"DistillLoss.kind must be a registered divergence "
                f"({', '.join(DIVERGENCES.names())}), got {self.kind!r}"
            )
        if self.mode not in MODES:
            raise ValueError(f"DistillLoss.mode must be one of {MODES}, got {self.mode!r}")
        c = self.chunk_size
        if c is not None and c != AUTO and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(
                f"DistillLoss.chunk_size must be None (dense logits), 'auto' or a "
                f"positive int (positions per chunk), got {c!r}"
            )
        if self.tis_cap is not None and not self.tis_cap >= 1.0:
            raise ValueError(
                f"DistillLoss.tis_cap must be None or >= 1 (a cap below 1 would "
                f"down-weight on-policy tokens, whose weight is 1), got {self.tis_cap!r}"
            )

    def check_examples(self, examples: Sequence[DistillExample]) -> None:
        """Refuses (ValueError naming every one) greedy examples for kind "sampled":
        temperature 0 leaves no distribution for the estimator to be unbiased under.
        A configuration mistake (how the responses were sampled), not a bad trace."""
        if self.kind != "sampled":
            return
        greedy = [
            f"example {i} ({e.task!r}, agent {e.agent!r}) was sampled greedily "
            f"(temperature {e.temperature})"
            for i, e in enumerate(examples)
            if e.temperature is not None and e.temperature <= 0
        ]
        if greedy:
            raise ValueError(
                f"DistillLoss(kind='sampled'): {len(greedy)} of {len(examples)} examples "
                f"are greedy: {'; '.join(greedy)}; the sampled estimator needs responses "
                "drawn from a distribution: sample with temperature > 0, or use a "
                "full-vocabulary kind (reverse_kl, forward_kl, jsd), exact at every position"
            )

    def usable_examples(
        self, examples: Sequence[DistillExample]
    ) -> tuple[list[DistillExample], dict[str, int]]:
        """(the examples this loss can score, {"skipped/constrained": n}).

        Kind "sampled" refuses greedy examples (`check_examples`: a configuration
        mistake, every one named) and leaves out those sampled under a grammar
        (`DistillExample.constraint`): their recorded log-probs are under the
        grammar's mask, which the student's scoring does not replay; they are
        counted. The full-vocabulary kinds keep every example."""
        if self.kind != "sampled":
            return list(examples), {"skipped/constrained": 0}
        self.check_examples(examples)
        kept = [e for e in examples if e.constraint is None]
        return kept, {"skipped/constrained": len(examples) - len(kept)}

    def unrecorded_sampling(self, examples: Sequence[DistillExample]) -> dict[str, int]:
        """Kind "sampled": how many examples (`unrecorded_sampling`) and trained tokens
        (`unrecorded_sampling_tokens`) record no sampling parameters (temperature
        None) and are scored at the loss temperature with importance weight 1 (right
        only if the current student drew them there); 0 for the other kinds."""
        if self.kind != "sampled":
            return {"unrecorded_sampling": 0, "unrecorded_sampling_tokens": 0}
        blind = [e for e in examples if e.temperature is None]
        return {
            "unrecorded_sampling": len(blind),
            "unrecorded_sampling_tokens": sum(e.num_trained for e in blind),
        }

    def _inputs(self, batch) -> dict:
        x = {"targets": batch.targets, "mask": batch.loss_mask.astype(jnp.float32)}
        if self.kind == "sampled":
            x.update(_sampling_inputs(batch, self.temperature))
        return x

    def _terms(self, logits, x):
        """Per-position loss and metric values of student / teacher logits [..., V_s],
        [..., V_t], over their first min(V_s, V_t) ids (`_common_ids`)."""
        s, t = _common_ids(logits)
        t = jax.lax.stop_gradient(t)
        y, out = x["targets"], {}
        if self.kind == "sampled":
            temperature = x["temperature"]
            loss, w = sampled_token_loss(
                s,
                t,
                y,
                temperature=temperature,
                top_k=x["top_k"],
                top_p=x["top_p"],
                sampler_logprobs=x["sampler_logprobs"],
                recorded=x["recorded"],
                tis_cap=self.tis_cap,
                return_weights=True,
            )
            loss = jnp.where(x["mask"] > 0, loss, 0.0)
            out["tis_weight"] = w
            if self.tis_cap is not None:
                capped = (x["recorded"] > 0) & (w >= self.tis_cap)
                out["tis_capped"] = capped.astype(jnp.float32)
        else:
            temperature = jnp.full(y.shape, self.temperature, jnp.float32)
            loss = distill_loss(
                s,
                t,
                y,
                kind=self.kind,
                beta=self.beta,
                top_k=self.top_k,
                temperature=self.temperature,
                mask=x["mask"],
            )
        s = jax.lax.stop_gradient(s)
        scale = temperature[..., None]
        return {
            "loss": loss,
            "kl": reverse_kl(s / scale, t / scale),
            "kl_temperature": temperature,
            "student_logp": token_logprobs(s, y),
            "teacher_logp": token_logprobs(t, y),
            **out,
        }

    def _finish(self, terms, m):
        return terms.pop("loss"), {k: (v * m).sum() for k, v in terms.items()}

    def __call__(
        self, logits: jax.Array, batch, extras: dict | None = None
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        if not extras or "teacher_logits" not in extras:
            raise ValueError(
                "DistillLoss called on logits needs extras={'teacher_logits': "
                "[rows, seq_len, vocab]}; the train step runs the teacher itself "
                "(from_model, extras=teacher_extras(paired))"
            )
        x = self._inputs(batch)
        return self._finish(self._terms([logits, extras["teacher_logits"]], x), x["mask"])

    def from_model(self, model: StepModel, batch, extras=None):
        th = teacher_hidden(model, extras)
        sh = model.hidden(batch.tokens, batch.positions, batch.segment_ids, batch.subtree_end)
        x = self._inputs(batch)
        return self._finish(_apply(self._terms, model, sh, th, x, self.chunk_size), x["mask"])


def distill_objective(divergence: str) -> type[DistillLoss]:
    """The objective "distill_<divergence>" (registered in `OBJECTIVES` on the first
    call): `DistillLoss` with `kind` fixed to `divergence`, a registered divergence
    (`losses.DIVERGENCES`; an unknown one is a did-you-mean ValueError). The
    built-in divergences' objectives are registered when this module is imported;
    a divergence registered later gets its objective from one call here."""
    name = f"distill_{divergence}"
    if name in OBJECTIVES:
        return OBJECTIVES.get(name)
    DIVERGENCES.get(divergence)
    namespace = {
        "__annotations__": {"kind": "str"},
        "kind": dataclasses.field(default=divergence, init=False),
        "__module__": __name__,
        "__qualname__": f"DistillLoss_{divergence}",
        "__doc__": f"`DistillLoss(kind={divergence!r})` as the objective {name!r}.",
    }
    cls: type[DistillLoss] = dataclasses.dataclass(frozen=True)(
        type(f"DistillLoss_{divergence}", (DistillLoss,), namespace)
    )
    OBJECTIVES.register(name)(cls)
    return cls


for _divergence in DIVERGENCES.names():
    distill_objective(_divergence)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def teacher_logits(graphdef, params, rest, teacher_batch, teacher_index) -> jax.Array:
    """Dense reference: teacher logits gathered into the student layout [R, L, V],
    gradient stopped (diagnostics and tests; the step runs the teacher itself)."""
    logits = forward(graphdef, params, rest, teacher_batch)
    return jax.lax.stop_gradient(jnp.take_along_axis(logits, teacher_index[..., None], axis=1))


def _rank(kind, beta, top_k, temperature, logits, x):
    """RMSD ranking value per position, from the distributions the loss uses: the
    divergence (logits over `temperature`), or for kind "sampled" |log p_t(y) -
    log pi_s(y)| at each token's sampling parameters (`_sampling_inputs` in x); 0
    off the mask. Over the common ids of the two heads (`_common_ids`)."""
    s, t = _common_ids(logits)
    if kind == "sampled":
        d = jnp.abs(
            sampled_token_advantage(
                s,
                t,
                x["targets"],
                temperature=x["temperature"],
                top_k=x["top_k"],
                top_p=x["top_p"],
            )
        )
        return jnp.where(x["mask"] > 0, d, 0.0)
    return distill_loss(
        s,
        t,
        x["targets"],
        kind=kind,
        beta=beta,
        top_k=top_k,
        temperature=temperature,
        mask=x["mask"],
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "kind", "beta", "top_k", "temperature"))
def divergence(
    graphdef,
    params,
    rest,
    student_batch,
    t_logits,
    *,
    kind="reverse_kl",
    beta=0.5,
    top_k=None,
    temperature=1.0,
) -> jax.Array:
    """Dense reference: per-position teacher-student divergence [R, L] (0 off the
    loss mask) from given teacher logits [R, L, V]."""
    s = forward(graphdef, params, rest, student_batch)
    x = {"targets": student_batch.targets, "mask": student_batch.loss_mask}
    if kind == "sampled":
        x.update(_sampling_inputs(student_batch, temperature))
    return _rank(kind, beta, top_k, temperature, [s, t_logits], x)


@functools.partial(jax.jit, static_argnames=("graphdef", "loss"))
def relevance_scores(
    graphdef, params, teacher_params, rest, student_batch, extras, loss: DistillLoss
) -> tuple[jax.Array, jax.Array]:
    """(divergence [R, L] as `divergence` ranks it, teacher argmax token [R, L]) with
    the teacher run here (teacher_params None: params) and `loss.chunk_size` chunking."""
    model = StepModel(graphdef, params, rest, teacher_params)
    b = student_batch
    sh = model.hidden(b.tokens, b.positions, b.segment_ids, b.subtree_end)

    def fn(logits, x):
        return {
            "div": _rank(loss.kind, loss.beta, loss.top_k, loss.temperature, logits, x),
            "argmax": jnp.argmax(logits[1], axis=-1).astype(jnp.int32),
        }

    out = _apply(
        fn,
        model,
        sh,
        teacher_hidden(model, extras),
        loss._inputs(b),
        loss.chunk_size,
    )
    return out["div"], out["argmax"]
