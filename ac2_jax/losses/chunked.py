"""Per-token log-probs, entropies and divergences from hidden states, chunk by chunk.

The dense path projects hidden states [..., L, D] to fp32 logits [..., L, V]
and keeps them (and their gradient) alive: 5 GB per 8k-token row at V=151,936.
Here the sequence axis is cut into chunks of `chunk_size` positions (all rows
together, so data-parallel row sharding is untouched); each chunk's logits
[..., C, V] are projected, used and dropped inside a `lax.scan` whose body is
`jax.checkpoint`ed, so the backward pass recomputes one chunk's logits at a
time. Neither pass ever holds more than one chunk of logits (a few
[..., C, V] buffers); the gradient of the head weight is accumulated across
chunks.

Only the sequence is chunked, never the vocabulary: the sampling transform
(`sampling_logits`: top-k / top-p sort the whole row) and every divergence
need a full row of V logits per position, and one row is small.

Values are the dense functions applied to each chunk (position-wise), so they
equal the dense path up to fp32 summation order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from ac2_jax.losses.distill import distill_loss
from ac2_jax.losses.logprobs import token_entropy, token_logprobs

HEAD_LAYOUTS = ("dv", "vd")


@dataclasses.dataclass(frozen=True)
class LMHead:
    """The output projection: `weight` [D, V] (layout "dv") or [V, D] ("vd", e.g. tied
    embeddings). `logits(hidden)` casts the weight to hidden's dtype and accumulates in fp32."""

    weight: jax.Array
    layout: str = "dv"

    def __post_init__(self):
        if self.layout not in HEAD_LAYOUTS:
            raise ValueError(
                f"LMHead.layout must be one of {HEAD_LAYOUTS} ([D, V] or [V, D]), "
                f"got {self.layout!r}"
            )

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[0 if self.layout == "dv" else 1]

    @property
    def vocab_size(self) -> int:
        return self.weight.shape[1 if self.layout == "dv" else 0]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., D] -> fp32 logits [..., V]."""
        eq = "...d,dv->...v" if self.layout == "dv" else "...d,vd->...v"
        return jnp.einsum(
            eq, hidden, self.weight.astype(hidden.dtype), preferred_element_type=jnp.float32
        )


jax.tree_util.register_dataclass(LMHead, data_fields=["weight"], meta_fields=["layout"])


def _check_chunk_size(chunk_size):
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(
            f"chunked: chunk_size must be a positive int (positions per chunk, "
            f"e.g. 1024), got {chunk_size!r}"
        )


def chunked_logits_map(
    fn: Callable,
    projections: Sequence[tuple[jax.Array, LMHead]],
    per_token=None,
    *,
    chunk_size: int,
):
    """Applies a position-wise `fn` to the logits of every projection, `chunk_size`
    positions of the sequence axis at a time, never holding more than one chunk of logits.

    projections: (hidden [*B, L, D], head) pairs, every hidden with the same leading
    shape [*B, L]. per_token: a pytree of arrays [*B, L, ...] (targets, masks, ...).
    fn(logits, chunk) gets a list of fp32 [*B, C, V_i] (one per projection) and
    per_token cut to [*B, C, ...]; it returns a pytree of [*B, C, ...]. Returns that
    pytree with [*B, L, ...] leaves. The batch axes stay whole (a chunk holds
    prod(B) x C positions), so rows sharded over devices stay where they are.
    Differentiable: the backward pass recomputes each chunk's logits.
    """
    _check_chunk_size(chunk_size)
    if not projections:
        raise ValueError("chunked_logits_map: needs at least one (hidden, head) pair")
    lead = tuple(projections[0][0].shape[:-1])
    for i, (h, head) in enumerate(projections):
        if not isinstance(head, LMHead):
            raise TypeError(
                f"chunked_logits_map: projection {i}'s head must be an LMHead, "
                f"got {type(head).__name__}"
            )
        if len(lead) < 1 or tuple(h.shape[:-1]) != lead or h.shape[-1] != head.hidden_size:
            raise ValueError(
                f"chunked_logits_map: projection {i}: hidden {h.shape} must be "
                f"[*{lead}, {head.hidden_size}] ([..., L, D] with the head's D)"
            )
    per_token = {} if per_token is None else per_token
    for x in jax.tree.leaves(per_token):
        if tuple(x.shape[: len(lead)]) != lead:
            raise ValueError(
                f"chunked_logits_map: per-token array {x.shape} must start with "
                f"the hidden states' leading shape {lead}"
            )
    axis, n = len(lead) - 1, lead[-1]
    if n == 0:
        raise ValueError(f"chunked_logits_map: no positions (leading shape {lead})")
    c = min(chunk_size, n)
    k = -(-n // c)

    def cut(x):  # [*B, L, ...] -> [k, *B, c, ...]; the last chunk repeats position L - 1
        if k * c > n:
            last = jax.lax.slice_in_dim(x, n - 1, n, axis=axis)
            x = jnp.concatenate([x, jnp.repeat(last, k * c - n, axis=axis)], axis=axis)
        x = x.reshape(*x.shape[:axis], k, c, *x.shape[axis + 1 :])
        return jnp.moveaxis(x, axis, 0)

    def join(y):  # [k, *B, c, ...] -> [*B, L, ...]
        y = jnp.moveaxis(y, 0, axis)
        y = y.reshape(*y.shape[:axis], k * c, *y.shape[axis + 2 :])
        return jax.lax.slice_in_dim(y, 0, n, axis=axis)

    heads = [head for _, head in projections]
    xs = ([cut(h) for h, _ in projections], jax.tree.map(cut, per_token))

    @functools.partial(jax.checkpoint, prevent_cse=False)  # saves nothing: recomputed
    def body(heads, x):
        hs, tok = x
        return fn([head.logits(h) for head, h in zip(heads, hs, strict=True)], tok)

    def loop(heads, xs):
        return jax.lax.scan(lambda carry, x: (carry, body(heads, x)), None, xs)[1]

    rows = _row_axes(lead)
    ys = loop(heads, xs) if rows is None else _per_shard(loop, heads, xs, rows)
    return jax.tree.map(join, ys)


def _row_axes(lead) -> tuple[str, ...] | None:
    """The mesh axes the chunk loop runs its rows over, one row block per device:
    under a mesh (`jax.set_mesh`) whose axes of size > 1 all split the first batch
    axis evenly (data / FSDP meshes); None otherwise (no mesh, a tensor or expert
    axis, rows that do not split, or no batch axis): the loop is left to XLA."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or len(lead) < 2:
        return None
    axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
    ways = math.prod(mesh.shape[a] for a in axes)
    return axes if axes and lead[0] % ways == 0 else None


def _per_shard(loop, heads, xs, rows):
    """`loop(heads, xs)` in shard_map, each device over its own rows (axis 1 of every
    [k, *B, c, ...] leaf): each head is gathered whole ONCE before the chunk loop and
    its gradient summed over the chunks locally, reduced over devices once after it
    (the all-gather's transpose, a reduce-scatter). Left to XLA, an FSDP-sharded head
    closed over by the scan is all-gathered in every trip of the forward and backward
    loops and its gradient all-reduced in every trip (issue 69: 256 trips, ~975 GB of
    collectives a Qwen3-8B step)."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.get_abstract_mesh()
    ways = math.prod(mesh.shape[a] for a in rows)

    def spec(head):  # the model width split over the rows' axes (FSDP's layout) if it divides
        d = 0 if head.layout == "dv" else 1
        split = head.hidden_size % ways == 0
        return d, split, P(*[rows if (i == d and split) else None for i in range(2)])

    specs = [spec(h) for h in heads]
    head_specs = [LMHead(s, h.layout) for (_, _, s), h in zip(specs, heads, strict=True)]
    row_spec = lambda x: P(None, rows)  # noqa: E731

    def local(heads, xs):
        whole = []
        for (d, split, _), head in zip(specs, heads, strict=True):
            w = head.weight
            # replicated (a width the devices do not divide): marked per-device, so its
            # gradient is summed over them once, after the loop
            w = (
                jax.lax.all_gather(w, rows, axis=d, tiled=True)
                if split
                else jax.lax.pcast(w, rows, to="varying")
            )
            whole.append(LMHead(w, head.layout))
        return loop(whole, xs)

    out_shape = jax.eval_shape(loop, heads, xs)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(head_specs, jax.tree.map(row_spec, xs)),
        out_specs=jax.tree.map(row_spec, out_shape),
    )(heads, xs)


def chunked_token_logprobs(
    hidden: jax.Array,
    head: LMHead,
    targets: jax.Array,
    *,
    temperature=None,
    top_k=None,
    top_p=None,
    chunk_size: int,
    with_entropy: bool = False,
    constraint_ids: jax.Array | None = None,
    constraint_masks: jax.Array | None = None,
):
    """`token_logprobs(head.logits(hidden), targets, ...)` chunk by chunk.

    hidden [..., L, D]; targets [..., L] int; temperature / top_k / top_p: None,
    scalars or [..., L] (the sampling distribution, see `sampling_logits`);
    constraint_ids [..., L] and constraint_masks uint32 [K, W]: grammar masks
    applied first (`constrain_logits`; the table is whole in every chunk).
    Returns log p [..., L]; with_entropy: (log p, entropy of the raw, unmasked
    softmax [..., L], gradient stopped: a metric) from one pass over the logits.
    """
    lead = tuple(hidden.shape[:-1])
    if tuple(targets.shape) != lead:
        raise ValueError(
            f"chunked_token_logprobs: targets {targets.shape} must be hidden.shape[:-1] = {lead}"
        )
    sampling = not (temperature is None and top_k is None and top_p is None)
    tok = {"targets": targets.astype(jnp.int32)}
    if sampling:
        tok["t"] = jnp.broadcast_to(
            jnp.asarray(1.0 if temperature is None else temperature, jnp.float32), lead
        )
        tok["k"] = jnp.broadcast_to(jnp.asarray(0 if top_k is None else top_k, jnp.int32), lead)
        tok["p"] = jnp.broadcast_to(jnp.asarray(1.0 if top_p is None else top_p, jnp.float32), lead)
    if (constraint_ids is None) != (constraint_masks is None):
        raise ValueError(
            "chunked_token_logprobs: constraint_ids and constraint_masks go together; "
            "pass both or neither"
        )
    if constraint_ids is not None:
        if tuple(constraint_ids.shape) != lead:
            raise ValueError(
                f"chunked_token_logprobs: constraint_ids {constraint_ids.shape} must be "
                f"hidden.shape[:-1] = {lead}"
            )
        tok["cid"] = constraint_ids.astype(jnp.int32)

    def fn(logits, x):
        (z,) = logits
        masks = {}
        if constraint_masks is not None:
            masks = dict(constraint_ids=x["cid"], constraint_masks=constraint_masks)
        out = {
            "logp": (
                token_logprobs(
                    z, x["targets"], temperature=x["t"], top_k=x["k"], top_p=x["p"], **masks
                )
                if sampling
                else token_logprobs(z, x["targets"], **masks)
            )
        }
        if with_entropy:
            out["entropy"] = token_entropy(jax.lax.stop_gradient(z))
        return out

    out = chunked_logits_map(fn, [(hidden, head)], tok, chunk_size=chunk_size)
    return (out["logp"], out["entropy"]) if with_entropy else out["logp"]


def chunked_token_entropy(hidden: jax.Array, head: LMHead, *, chunk_size: int) -> jax.Array:
    """`token_entropy(head.logits(hidden))` chunk by chunk (differentiable).
    hidden [..., L, D] -> [..., L]."""
    return chunked_logits_map(
        lambda logits, _: token_entropy(logits[0]), [(hidden, head)], chunk_size=chunk_size
    )


def chunked_distill_loss(
    student_hidden: jax.Array,
    student_head: LMHead,
    teacher_hidden: jax.Array,
    teacher_head: LMHead,
    targets: jax.Array | None = None,
    *,
    kind: str = "reverse_kl",
    beta: float = 0.5,
    top_k: int | None = None,
    temperature: float = 1.0,
    mask: jax.Array | None = None,
    chunk_size: int,
) -> jax.Array:
    """`distill_loss(student logits, teacher logits, ...)` chunk by chunk.

    student_hidden, teacher_hidden [..., L, D] (aligned like the logits of
    `distill_loss`); the heads may differ (a frozen teacher's). Teacher
    gradients are stopped. targets / mask [..., L]. Returns [..., L].
    """
    lead = tuple(student_hidden.shape[:-1])
    if tuple(teacher_hidden.shape[:-1]) != lead:
        raise ValueError(
            f"chunked_distill_loss: teacher_hidden {teacher_hidden.shape} and "
            f"student_hidden {student_hidden.shape} must share [..., L]"
        )
    if student_head.vocab_size != teacher_head.vocab_size:
        raise ValueError(
            f"chunked_distill_loss: student vocabulary {student_head.vocab_size} "
            f"!= teacher vocabulary {teacher_head.vocab_size}"
        )
    for name, x in (("targets", targets), ("mask", mask)):
        if x is not None and tuple(x.shape) != lead:
            raise ValueError(
                f"chunked_distill_loss: {name} {x.shape} must be student_hidden.shape[:-1] = {lead}"
            )
    tok = {k: v for k, v in (("targets", targets), ("mask", mask)) if v is not None}
    teacher = (jax.lax.stop_gradient(teacher_hidden), jax.lax.stop_gradient(teacher_head))

    def fn(logits, x):
        return distill_loss(
            logits[0],
            logits[1],
            x.get("targets"),
            kind=kind,
            beta=beta,
            top_k=top_k,
            temperature=temperature,
            mask=x.get("mask"),
        )

    return chunked_logits_map(
        fn, [(student_hidden, student_head), teacher], tok, chunk_size=chunk_size
    )
