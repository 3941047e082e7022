"""Loss functions for the train step, and the token weights that make them exact
under sharding, pmap and gradient accumulation.

The normaliser is `ac2_jax.losses.loss_weights`: every
aggregation is linear in the per-token losses once its normalizers (per-task /
per-segment / total token counts) are fixed, and those depend only on the
batch, never on the params. So the step computes `w = loss_weights(full
batch)` once and the loss is `sum(w * per_token)` over any split of the rows:
micro-batches add up, pmap devices psum, and no gradient ever flows through a
collective.

A LossFn maps (logits [R, L, V], batch, extras) to (per_token [R, L],
metric_sums): each metric sum is `sum(loss_mask * value)` over the given rows;
the step divides by the global `sum(loss_mask)` (token-mean metrics).
A loss may instead read the model: with a `from_model(model: StepModel, batch,
extras)` method the step calls that (`apply_loss`), so the loss can take
hidden states and the head and never build [R, L, V] logits (`chunk_size`:
`ac2_jax.losses.chunked_logits_map`), or run a teacher inside the step.
`chunk_size="auto"` (the default of SFTLoss / PolicyGradientLoss) picks dense
logits or a chunk from the batch's shape and the vocabulary when the step is
traced (`models.memory_plan.logprob_chunk_for`: chunked once the rows' fp32
logits exceed 160 MiB, e.g. 256 positions of one row at a 151,936 vocabulary).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from ac2_jax.losses import (
    MODES,
    LMHead,
    chunked_token_logprobs,
    policy_gradient_loss,
    policy_gradient_metrics,
    token_entropy,
    token_logprobs,
)
from ac2_jax.models.memory_plan import AUTO, logprob_chunk_for
from ac2_jax.registry import Registry
from ac2_jax.segments import CONSTRAINT_ID, SAMPLER_LOGPROBS

ADVANTAGES = "advantages"  # the batch feature: each trained token's advantage

OLD_LOGPROBS = ("detached", "sampler", "extras")


def lm_head_of(model) -> LMHead:
    """A model's output projection as an LMHead (`models.CausalLM.head`):
    `lm_head_of(model).logits(h)` equals `model.logits(h)`."""
    head = getattr(model, "head", None)
    if not callable(head):
        raise TypeError(
            f"lm_head_of: {type(model).__name__} has no head(); a model the "
            "chunked losses read must meet ac2_jax.models.CausalLM (logits, "
            "hidden_states, head)"
        )
    return head()


def _check_chunk_size(name, chunk_size):
    if (
        chunk_size is not None
        and chunk_size != AUTO
        and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1)
    ):
        raise ValueError(
            f"{name}.chunk_size must be None (dense logits), 'auto' or a positive int "
            f"(positions per chunk, e.g. 1024), got {chunk_size!r}"
        )


def resolve_chunk_size(chunk_size, model: StepModel, batch) -> int | None:
    """A loss's chunk_size for this batch: as set, or for "auto" dense logits (None)
    or the chunk `logprob_chunk_for` picks from [rows, length] and the vocabulary."""
    if chunk_size != AUTO:
        return chunk_size
    rows, length = batch.tokens.shape[:2]
    return logprob_chunk_for(rows, length, model.head().vocab_size)


@dataclasses.dataclass(frozen=True)
class StepModel:
    """The model inside the train step, as a loss reads it.

    params: the trained params (gradients flow). teacher_params: a frozen
    teacher's (fixed / EMA copy); None means the live teacher, i.e. `params`
    with the gradient stopped. Teacher outputs never carry gradients.
    """

    graphdef: Any
    params: Any
    rest: Any
    teacher_params: Any = None

    def module(self, teacher: bool = False):
        if not teacher:
            return nnx.merge(self.graphdef, self.params, self.rest)
        p = self.params if self.teacher_params is None else self.teacher_params
        return nnx.merge(self.graphdef, jax.lax.stop_gradient(p), self.rest)

    def logits(self, batch) -> jax.Array:
        """fp32 logits [R, L, V] of a packed batch (the dense path); a batch with
        recorded MoE routing (`PackedBatch.routing`) replays it."""
        module = self.module()
        return module(
            batch.tokens,
            batch.positions,
            batch.segment_ids,
            batch.subtree_end,
            **routing_kw(module, getattr(batch, "routing", None)),
        )

    def hidden(
        self,
        tokens,
        positions,
        segment_ids,
        subtree_end=None,
        *,
        teacher: bool = False,
        routing=None,
    ) -> jax.Array:
        """Final normed hidden states [R, L, D] of packed rows ([R, L] int inputs);
        routing: None, or the recorded MoE routing to replay ([R, L, layers, k])."""
        module = self.module(teacher)
        return module.hidden_states(
            tokens, positions, segment_ids, subtree_end, **routing_kw(module, routing)
        )

    def project(self, hidden: jax.Array, *, teacher: bool = False) -> jax.Array:
        """The model's own fp32 logits [..., V] of hidden states [..., D] (dense)."""
        return self.module(teacher).logits(hidden)

    def head(self, teacher: bool = False) -> LMHead:
        """The output projection (for the chunked path: `LMHead.logits` == `project`)."""
        return lm_head_of(self.module(teacher))


def routing_kw(module, routing) -> dict:
    """The `routing=` keyword of a model's forward for a batch's recorded MoE routing
    (routing replay, `models.moe_decoder`): {} when there is none; an error for a
    model that has no experts to route."""
    if routing is None:
        return {}
    if not hasattr(module, "forward_with_router"):
        raise ValueError(
            f"the batch carries recorded MoE routing (PackedBatch.routing) but the model "
            f"({type(module).__name__}) has no experts; train it with "
            "rl.moe.routing='recompute' (no routing in the batch)"
        )
    return {"routing": routing}


def apply_loss(loss_fn, model: StepModel, batch, extras):
    """(per_token, metric sums) of `loss_fn` inside the step: its `from_model` when it
    has one, else `loss_fn(model.logits(batch), batch, extras)`."""
    from_model = getattr(loss_fn, "from_model", None)
    if from_model is not None:
        return from_model(model, batch, extras)
    return loss_fn(model.logits(batch), batch, extras)


def constraint_args(batch) -> dict:
    """The grammar masks of a batch as `token_logprobs` keywords: {} when the batch has
    no mask table (`PackedBatch.constraint_masks` None: the unconstrained path, as
    it always compiled), else its `CONSTRAINT_ID` feature and table."""
    table = getattr(batch, "constraint_masks", None)
    if table is None:
        return {}
    if CONSTRAINT_ID not in batch.features:
        raise ValueError(
            "the batch has constraint_masks but no feature "
            f"{CONSTRAINT_ID!r} to index them; pack segments that carry it "
            "(segments_from_trace(constraint_masks=...), pack_segments)"
        )
    return dict(constraint_ids=batch.features[CONSTRAINT_ID], constraint_masks=table)


def behaviour_logprobs(logits: jax.Array, batch) -> jax.Array:
    """Learner log-probs [R, L] of batch.targets under the distribution the sampler drew
    them from (the batch's temperature / top_k / top_p, after the grammar mask of
    constrained tokens: `constraint_args`), comparable to sampler_logprobs."""
    return token_logprobs(
        logits,
        batch.targets,
        temperature=batch.temperature,
        top_k=batch.top_k,
        top_p=batch.top_p,
        **constraint_args(batch),
    )


def model_logprobs(
    model: StepModel, batch, *, behaviour: bool, entropy: bool, chunk_size: int | str | None
):
    """(log p [R, L], entropy [R, L] or None) of batch.targets under the model.

    behaviour: under the batch's sampling parameters and grammar masks
    (`behaviour_logprobs`), else the raw softmax. Entropy (of the raw,
    unmasked softmax: a metric of the model) has its gradient stopped.
    chunk_size None: from dense logits; else from hidden states and the head,
    `chunk_size` positions at a time (no [R, L, V] array); "auto": either, by
    the batch's shape (`resolve_chunk_size`).
    """
    chunk_size = resolve_chunk_size(chunk_size, model, batch)
    if chunk_size is None:
        logits = model.logits(batch)
        logp = (
            behaviour_logprobs(logits, batch)
            if behaviour
            else token_logprobs(logits, batch.targets)
        )
        return logp, (jax.lax.stop_gradient(token_entropy(logits)) if entropy else None)
    h = model.hidden(
        batch.tokens,
        batch.positions,
        batch.segment_ids,
        batch.subtree_end,
        routing=getattr(batch, "routing", None),
    )
    sampling = (
        dict(
            temperature=batch.temperature,
            top_k=batch.top_k,
            top_p=batch.top_p,
            **constraint_args(batch),
        )
        if behaviour
        else {}
    )
    out = chunked_token_logprobs(
        h, model.head(), batch.targets, chunk_size=chunk_size, with_entropy=entropy, **sampling
    )
    return out if entropy else (out, None)


class LossFn(Protocol):
    """What the train step needs from a loss (optionally also `from_model`, see
    `apply_loss`)."""

    @property
    def mode(self) -> str: ...  # read-only: frozen dataclass losses satisfy it

    @property
    def normalizer(self) -> float | None: ...

    def __call__(
        self, logits: jax.Array, batch, extras: dict | None
    ) -> tuple[jax.Array, dict[str, jax.Array]]: ...


# The train step's objectives by name: a config picks one with `kind` (e.g.
# `rl.loss = dict(kind="ppo", clip_eps=0.2)`); a new objective is a subclass of
# `Objective` registered here from its own module (`@OBJECTIVES.register("name")`).
OBJECTIVES: Registry[type] = Registry("objective")


class Objective(abc.ABC):
    """Base of the train step's losses (an `LossFn`): `mode` is the aggregation
    (`ac2_jax.losses.MODES`), `normalizer` the constant of mode="constant".

    Subclass it as a frozen dataclass, implement `__call__(logits [R, L, V],
    batch, extras) -> (per_token [R, L], metric sums)` (and optionally
    `from_model`, see `apply_loss`), and register it in `OBJECTIVES`. A config
    field typed `Objective` is built from a section's `kind` (default "ppo").
    """

    __registry__ = OBJECTIVES
    __default_kind__ = "ppo"
    mode: str
    normalizer: float | None

    @abc.abstractmethod
    def __call__(
        self, logits: jax.Array, batch, extras: dict | None
    ) -> tuple[jax.Array, dict[str, jax.Array]]: ...


def _check_mode(name, mode):
    if mode not in MODES:
        raise ValueError(f"{name}.mode must be one of {MODES}, got {mode!r}")


def _masked_sum(x, batch):
    return (x * batch.loss_mask.astype(jnp.float32)).sum()


@OBJECTIVES.register("sft")
@dataclasses.dataclass(frozen=True)
class SFTLoss(Objective):
    """Masked next-token NLL: l_t = -log p(target_t). Metric: entropy.

    chunk_size: None reads dense logits; an int reads hidden states and
    projects `chunk_size` positions at a time (same values, no [R, L, V]);
    "auto" (default) picks one of the two per batch shape (`resolve_chunk_size`).
    """

    mode: str = "task_mean"
    normalizer: float | None = None
    entropy: bool = True
    chunk_size: int | str | None = AUTO

    def __post_init__(self):
        _check_mode("SFTLoss", self.mode)
        _check_chunk_size("SFTLoss", self.chunk_size)

    def _finish(self, logp, ent, batch):
        return -logp, ({"entropy": _masked_sum(ent, batch)} if self.entropy else {})

    def __call__(self, logits, batch, extras=None):
        ent = jax.lax.stop_gradient(token_entropy(logits)) if self.entropy else None
        return self._finish(token_logprobs(logits, batch.targets), ent, batch)

    def from_model(self, model: StepModel, batch, extras=None):
        chunk = resolve_chunk_size(self.chunk_size, model, batch)
        if chunk is None:
            return self(model.logits(batch), batch, extras)
        logp, ent = model_logprobs(
            model, batch, behaviour=False, entropy=self.entropy, chunk_size=chunk
        )
        return self._finish(
            logp,
            ent,
            batch,
        )


@OBJECTIVES.register("ppo")
@dataclasses.dataclass(frozen=True)
class PolicyGradientLoss(Objective):
    """Clipped policy-gradient loss with truncated importance weights
    (`ac2_jax.losses.policy_gradient_loss`: decoupled PPO, optional dual clip).

    `old_logprobs` is where the PPO ratio's denominator (the proximal policy)
    comes from, and so which bound acts on the update:
      "detached" (default): the current learner log-probs, gradient stopped.
          One update per batch: the ratio is 1, so the clip cannot bind; the
          only bound is TIS, weight min(pi / pi_sampler, tis_cap) (no trust
          region: a token already 20x likelier than under the sampler keeps
          weight tis_cap). Metrics: tis_frac (no clip_frac: it is always 0).
      "sampler": the batch's sampler log-probs. The trust region against the
          behaviour policy: the ratio is pi / pi_sampler (the importance
          correction kept in it), clipped to [1 - eps, 1 + eps] where that
          removes gradient; with `dual_clip` c (Ye et al. 2020; 3 is usual) a
          token with A < 0 and ratio > c gets no gradient either. The TIS weight
          is 1. Metrics: clip_frac, dual_clip_frac.
      "extras": `extras["old_logprobs"]` [R, L], e.g. from `TrainStep.logprobs`
          before several updates on one batch (decoupled PPO, Hilton et al.
          2021: ratio to the pre-update policy, TIS weight of that policy to
          the sampler). Metrics: clip_frac, dual_clip_frac, tis_frac.
    Each of clip_frac / dual_clip_frac / tis_frac is the share of trained
    tokens that bound removed or truncated, reported only where it can be
    non-zero; a `dual_clip` that cannot bind (old_logprobs="detached") is an
    error. Reads the batch features `ADVANTAGES` and `SAMPLER_LOGPROBS` (what
    `ac2_jax.training.rl.pack_rl_batch` packs), and re-scores grammar-constrained
    tokens under their masks (`behaviour_logprobs`), so on-policy ratios are 1.
    chunk_size: as in `SFTLoss`. Metrics also: entropy (of the raw, unmasked
    softmax), kl_to_sampler.
    """

    mode: str = "task_mean"
    normalizer: float | None = None
    clip_eps: float | tuple[float, float] = 0.2
    tis_cap: float | None = 2.0
    old_logprobs: str = "detached"
    entropy: bool = True
    chunk_size: int | str | None = AUTO
    dual_clip: float | None = None

    def __post_init__(self):
        _check_mode("PolicyGradientLoss", self.mode)
        _check_chunk_size("PolicyGradientLoss", self.chunk_size)
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(
                f"PolicyGradientLoss.old_logprobs must be one of {OLD_LOGPROBS}, "
                f"got {self.old_logprobs!r}"
            )
        if self.tis_cap is not None and not self.tis_cap >= 1.0:
            raise ValueError(
                f"PolicyGradientLoss.tis_cap must be None or >= 1 (a cap below 1 would "
                f"down-weight on-policy tokens), got {self.tis_cap!r}"
            )
        if self.dual_clip is not None:
            if not self.dual_clip > 1.0:
                raise ValueError(
                    f"PolicyGradientLoss.dual_clip must be None or > 1 (3 is usual), "
                    f"got {self.dual_clip!r}"
                )
            if self.old_logprobs == "detached":
                raise ValueError(
                    "PolicyGradientLoss.dual_clip bounds the PPO ratio, which is 1 with "
                    "old_logprobs='detached' (one update per batch): it would never bind. "
                    "Use old_logprobs='sampler' (a trust region against the sampler) or "
                    "'extras' (several updates on one batch)"
                )

    def bounds(self) -> tuple[str, ...]:
        """The bounds that can act on the update, by their metric names: "clip_frac"
        (the PPO clip), "dual_clip_frac", "tis_frac" (the truncated weight)."""
        out = []
        if self.old_logprobs != "detached":  # a ratio that can leave 1
            out.append("clip_frac")
            if self.dual_clip is not None:
                out.append("dual_clip_frac")
        if self.tis_cap is not None and self.old_logprobs != "sampler":  # weight not 1
            out.append("tis_frac")
        return tuple(out)

    def _finish(self, logp, ent, batch, extras):
        m = batch.loss_mask.astype(jnp.float32)
        sampler, advantages = batch.feature(SAMPLER_LOGPROBS), batch.feature(ADVANTAGES)
        if self.old_logprobs == "detached":
            old = jax.lax.stop_gradient(logp)
        elif self.old_logprobs == "sampler":
            old = sampler
        else:
            if not extras or "old_logprobs" not in extras:
                raise ValueError(
                    "PolicyGradientLoss(old_logprobs='extras') needs "
                    "extras={'old_logprobs': [rows, seq_len]} in the step call"
                )
            old = extras["old_logprobs"]
        per_token = policy_gradient_loss(
            logp,
            old,
            sampler,
            advantages,
            m,
            clip_eps=self.clip_eps,
            tis_cap=self.tis_cap,
            dual_clip=self.dual_clip,
        )
        # policy_gradient_metrics returns sum(m x) / max(sum m, 1); undo the division.
        means = policy_gradient_metrics(
            jax.lax.stop_gradient(logp),
            old,
            sampler,
            m,
            advantages,
            clip_eps=self.clip_eps,
            dual_clip=self.dual_clip,
            tis_cap=self.tis_cap,
        )
        n = jnp.maximum(m.sum(), 1.0)
        keep = {"kl_to_sampler", *self.bounds()}
        sums = {k: v * n for k, v in means.items() if k in keep}
        if self.entropy:
            sums["entropy"] = _masked_sum(ent, batch)
        return per_token, sums

    def __call__(self, logits, batch, extras=None):
        ent = jax.lax.stop_gradient(token_entropy(logits)) if self.entropy else None
        return self._finish(behaviour_logprobs(logits, batch), ent, batch, extras)

    def from_model(self, model: StepModel, batch, extras=None):
        chunk = resolve_chunk_size(self.chunk_size, model, batch)
        if chunk is None:
            return self(model.logits(batch), batch, extras)
        logp, ent = model_logprobs(
            model, batch, behaviour=True, entropy=self.entropy, chunk_size=chunk
        )
        return self._finish(
            logp,
            ent,
            batch,
            extras,
        )
