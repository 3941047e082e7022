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
    KL_ESTIMATORS,
    LMHead,
    chunked_token_entropy,
    chunked_token_logprobs,
    kl_estimate,
    policy_gradient_loss,
    policy_gradient_metrics,
    resolve_mode,
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


def _check_mode(name, mode) -> str:
    try:
        return resolve_mode(mode)
    except ValueError as e:
        raise ValueError(f"{name}.mode{str(e).removeprefix('loss mode')}") from None


def _set_mode(obj, name):
    """Checks obj.mode and stores its canonical name (verl's spellings map to ours)."""
    object.__setattr__(obj, "mode", _check_mode(name, obj.mode))
    if obj.mode == "constant" and not (obj.normalizer is not None and obj.normalizer > 0):
        raise ValueError(
            f"{name}: mode 'constant' (verl's seq-mean-token-sum-norm) divides the token sum "
            f"by normalizer, which must be > 0 (e.g. the most tokens an attempt may "
            f"generate), got {obj.normalizer!r}"
        )
    if obj.normalizer is not None and obj.mode not in ("task_sum", "constant"):
        raise ValueError(
            f"{name}: normalizer={obj.normalizer!r} divides only the token sums of modes "
            f"'task_sum' and 'constant'; mode {obj.mode!r} would ignore it: drop it or "
            "pick one of those modes"
        )


def _refuse_inert(obj, name):
    """Nothing silent: a field set away from its kind's default that `inert_fields`
    says cannot act is one line naming the field and the kind (a default merely
    inherited and unused is not refused)."""
    defaults = {f.name: f.default for f in dataclasses.fields(obj)}
    for field, why in obj.inert_fields().items():
        value = getattr(obj, field)
        if value != defaults[field]:
            try:
                kind = repr(OBJECTIVES.name_of(obj))
            except ValueError:  # an unregistered subclass
                kind = name
            raise ValueError(
                f"{name}: {field}={value!r} has no effect with kind {kind} and "
                f"old_logprobs={obj.old_logprobs!r} ({why}); leave {field} at its default "
                f"({defaults[field]!r}) or pick an old_logprobs under which it acts"
            )


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
        _set_mode(self, "SFTLoss")
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


# extras key of a [R, L] float mask (1: the token was sampled by the weights the step
# starts from). Given, a `PolicyGradientLoss` adds `drift_sums` to its metric sums.
DRIFT_ONPOLICY = "drift_onpolicy"


def drift_sums(logp, sampler, mask, onpolicy) -> dict:
    """Sampler/learner drift from the loss's own forward (the drift alarm,
    `training.rl.alarms`): with d = logp - sampler over trained tokens (mask > 0),
    split by `onpolicy` [R, L] (1 on-policy, 0 stale), the sums
    _drift_{onpolicy,stale}_abs (sum |d|) and _drift_{onpolicy,stale}_kl (sum of
    k3 = exp(d) - 1 - d, as `kl_to_sampler`). Sums, so micro-batches (grad_accum)
    add up exactly; the step divides every metric sum by the batch's loss-mask sum,
    which the caller multiplies back. logp: the learner's log-probs at the weights
    the step starts from (before its update)."""
    trained = (mask > 0).astype(jnp.float32)
    d = logp - sampler
    k3 = jnp.exp(d) - 1.0 - d
    out = {}
    for kind, sel in (("onpolicy", trained * onpolicy), ("stale", trained * (1.0 - onpolicy))):
        out[f"_drift_{kind}_abs"] = jnp.where(sel > 0, jnp.abs(d), 0.0).sum()
        out[f"_drift_{kind}_kl"] = jnp.where(sel > 0, k3, 0.0).sum()
    return out


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

    Regularisers (every objective built on this class has them; 0 = off, the
    default, and then nothing extra is computed):
      kl_coef beta: adds beta * k(pi, pi_ref) per trained token
          (`losses.kl_estimate`, `kl_estimator` "k1" / "k2" / "k3", Schulman
          2020; GRPO's eq. 3-4 and TRL's beta use k3). The reference pi_ref
          is the step's teacher (`StepModel.teacher_params`: the launch
          weights, or with LoRA the base with the adapters zeroed, which the
          RLTrainer passes), scored in the same packed layout and chunking as
          the policy, under the batch's sampling parameters; a step without
          one is an error. Metric: kl_to_reference (token mean of k).
      entropy_coef c: subtracts c * H(pi(. | context)) per trained token (the
          raw softmax's entropy, gradient flowing: an entropy bonus, as TRL's
          entropy_coef / verl's entropy_coeff).
    """

    mode: str = "task_mean"
    normalizer: float | None = None
    clip_eps: float | tuple[float, float] = 0.2
    tis_cap: float | None = 2.0
    old_logprobs: str = "detached"
    entropy: bool = True
    chunk_size: int | str | None = AUTO
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self):
        name = type(self).__name__
        _set_mode(self, name)
        _check_chunk_size(name, self.chunk_size)
        if self.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(
                f"{name}.old_logprobs must be one of {OLD_LOGPROBS}, got {self.old_logprobs!r}"
            )
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"{name}.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}"
            )
        for field in ("kl_coef", "entropy_coef"):
            if not getattr(self, field) >= 0.0:
                raise ValueError(f"{name}.{field} must be >= 0, got {getattr(self, field)!r}")
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

        _refuse_inert(self, name)

    def inert_fields(self) -> dict[str, str]:
        """{field: why} for the fields that cannot act under this `old_logprobs`; a
        value other than the kind's default is refused by name (`__post_init__`):
        tis_cap with old_logprobs="sampler" (the TIS weight is 1)."""
        if self.old_logprobs == "sampler":
            return {"tis_cap": "the TIS weight pi / pi_sampler is the PPO ratio, so it is 1"}
        return {}

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

    @property
    def needs_reference(self) -> bool:
        """Whether the step must hand this loss a reference policy (kl_coef > 0)."""
        return self.kl_coef > 0

    def _old(self, logp, sampler, extras):
        if self.old_logprobs == "detached":
            return jax.lax.stop_gradient(logp)
        if self.old_logprobs == "sampler":
            return sampler
        if not extras or "old_logprobs" not in extras:
            raise ValueError(
                f"{type(self).__name__}(old_logprobs='extras') needs "
                "extras={'old_logprobs': [rows, seq_len]} in the step call"
            )
        return extras["old_logprobs"]

    def surrogate(self, logp, old, sampler, advantages, mask, batch) -> jax.Array:
        """The objective's per-token loss [R, L] (zero off the mask); subclasses
        override this and `bound_metrics`. Here: decoupled PPO with TIS."""
        return policy_gradient_loss(
            logp,
            old,
            sampler,
            advantages,
            mask,
            clip_eps=self.clip_eps,
            tis_cap=self.tis_cap,
            dual_clip=self.dual_clip,
        )

    def bound_metrics(self, logp, old, sampler, mask, advantages, batch) -> dict:
        """Token-mean metrics of the bounds that can act (logp without gradient)."""
        means = policy_gradient_metrics(
            logp,
            old,
            sampler,
            mask,
            advantages,
            clip_eps=self.clip_eps,
            dual_clip=self.dual_clip,
            tis_cap=self.tis_cap,
        )
        keep = {"kl_to_sampler", *self.bounds()}
        return {k: v for k, v in means.items() if k in keep}

    def _finish(self, logp, ent, batch, extras, ref_logp=None, ent_bonus=None):
        m = batch.loss_mask.astype(jnp.float32)
        sampler, advantages = batch.feature(SAMPLER_LOGPROBS), batch.feature(ADVANTAGES)
        old = self._old(logp, sampler, extras)
        per_token = self.surrogate(logp, old, sampler, advantages, m, batch)
        # The metrics are sum(m x) / max(sum m, 1); undo the division.
        means = self.bound_metrics(jax.lax.stop_gradient(logp), old, sampler, m, advantages, batch)
        n = jnp.maximum(m.sum(), 1.0)
        sums = {k: v * n for k, v in means.items()}
        if self.kl_coef > 0:
            if ref_logp is None:
                if not extras or "ref_logprobs" not in extras:
                    raise ValueError(
                        f"{type(self).__name__}(kl_coef > 0) needs the reference policy's "
                        "log-probs: run it through the train step with a reference "
                        "(step(state, batch, teacher=reference_params); RLTrainer does), or "
                        "pass extras={'ref_logprobs': [rows, seq_len]}"
                    )
                ref_logp = extras["ref_logprobs"]
            kl = jnp.where(m > 0, kl_estimate(logp, ref_logp, self.kl_estimator), 0.0)
            per_token = per_token + self.kl_coef * kl
            sums["kl_to_reference"] = _masked_sum(jax.lax.stop_gradient(kl), batch)
        if self.entropy_coef > 0:
            assert ent_bonus is not None
            per_token = per_token - self.entropy_coef * jnp.where(m > 0, ent_bonus, 0.0)
        if self.entropy:
            sums["entropy"] = _masked_sum(
                jax.lax.stop_gradient(ent if ent is not None else ent_bonus), batch
            )
        on = extras.get(DRIFT_ONPOLICY) if extras else None
        if on is not None:  # the drift alarm, from this forward (no other one)
            sums.update(drift_sums(jax.lax.stop_gradient(logp), sampler, m, on))
        return per_token, sums

    def __call__(self, logits, batch, extras=None):
        return self._dense(logits, batch, extras)

    def _dense(self, logits, batch, extras, ref_logp=None):
        """The loss from full logits (the entropy metric and bonus from them too)."""
        ent = token_entropy(logits) if (self.entropy or self.entropy_coef > 0) else None
        return self._finish(
            behaviour_logprobs(logits, batch),
            None if ent is None else jax.lax.stop_gradient(ent),
            batch,
            extras,
            ref_logp=ref_logp,
            ent_bonus=ent if self.entropy_coef > 0 else None,
        )

    def from_model(self, model: StepModel, batch, extras=None):
        chunk = resolve_chunk_size(self.chunk_size, model, batch)
        ref = None
        if self.kl_coef > 0 and not (extras and "ref_logprobs" in extras):
            ref = reference_logprobs(model, batch, chunk)
        if chunk is None:
            return self._dense(model.logits(batch), batch, extras, ref)
        if self.entropy_coef == 0:
            logp, ent = model_logprobs(
                model, batch, behaviour=True, entropy=self.entropy, chunk_size=chunk
            )
            return self._finish(logp, ent, batch, extras, ref_logp=ref)
        # The entropy bonus needs the entropy's gradient: one hidden-state pass, two maps.
        h = model.hidden(
            batch.tokens,
            batch.positions,
            batch.segment_ids,
            batch.subtree_end,
            routing=getattr(batch, "routing", None),
        )
        logp = chunked_token_logprobs(
            h, model.head(), batch.targets, chunk_size=chunk, **_sampling_args(batch)
        )
        bonus = chunked_token_entropy(h, model.head(), chunk_size=chunk)
        return self._finish(logp, None, batch, extras, ref_logp=ref, ent_bonus=bonus)


def _sampling_args(batch) -> dict:
    return dict(
        temperature=batch.temperature,
        top_k=batch.top_k,
        top_p=batch.top_p,
        **constraint_args(batch),
    )


def reference_logprobs(model: StepModel, batch, chunk_size: int | None) -> jax.Array:
    """Log-probs [R, L] of batch.targets under the reference policy (the step's
    teacher params, `StepModel.teacher_params`; gradient stopped), in the batch's
    packed layout and under its sampling parameters and grammar masks, dense or
    `chunk_size` positions at a time like the policy's. A step without a teacher
    has no reference (its live params would make every KL 0): an error."""
    if model.teacher_params is None:
        raise ValueError(
            "a KL to the reference policy (kl_coef > 0) needs the reference's params in "
            "the step: step(state, batch, teacher=reference_params) (RLTrainer passes the "
            "launch weights, or with LoRA the adapters zeroed)"
        )
    routing = getattr(batch, "routing", None)
    if chunk_size is None:
        module = model.module(teacher=True)
        logits = module(
            batch.tokens,
            batch.positions,
            batch.segment_ids,
            batch.subtree_end,
            **routing_kw(module, routing),
        )
        return jax.lax.stop_gradient(behaviour_logprobs(logits, batch))
    h = model.hidden(
        batch.tokens,
        batch.positions,
        batch.segment_ids,
        batch.subtree_end,
        teacher=True,
        routing=routing,
    )
    out = chunked_token_logprobs(
        h, model.head(teacher=True), batch.targets, chunk_size=chunk_size, **_sampling_args(batch)
    )
    return jax.lax.stop_gradient(out)
