"""Jitted pieces of the JaxSampler: token sampling, prefill, multi-step decode.

All functions work on a fixed set of `B` cache rows ("slots") so shapes stay
static; the host (`batching.SlotTable`) decides which request lives in which
row. Per-row sampling state travels as `Rows`, a pytree of [B] arrays.

A row's next input is `Rows.token` at position `Rows.pos` (not yet in the
cache). Every decode step writes that token into the cache, samples the next
one from its logits and advances `pos`; rows with `active == False` write
nothing (position -1) and keep their state. Sampling noise for output token i
of a row comes from `fold_in(key(seed), i)`, so a seeded request draws the
same tokens whatever rows share its batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from ac2_jax.losses.logprobs import sampling_logits
from ac2_jax.models.decoder import KVCache

# A `Rows` field: numpy on the host (`SlotTable.rows()`, and after `jax.device_get`),
# a jax array inside the jitted calls.
RowArray = jax.Array | np.ndarray


@struct.dataclass
class Rows:
    """Per-row decode state, every field [B] (stop_ids [B, NS], -1 = unused)."""

    token: RowArray  # int32: next input token (last prompt token, then last sample)
    pos: RowArray  # int32: its position / cache slot
    active: RowArray  # bool: still generating
    n_out: RowArray  # int32: output tokens sampled so far
    max_out: RowArray  # int32: stop after this many output tokens
    temperature: RowArray  # float32: 0 = greedy
    top_p: RowArray  # float32: 1 = off
    top_k: RowArray  # int32: <= 0 = off
    seed_lo: RowArray  # uint32
    seed_hi: RowArray  # uint32
    stop_ids: RowArray  # int32 [B, NS]
    adapter: RowArray  # int32: adapter bank slot (0 = the base model)


def row_keys(seed_lo: jax.Array, seed_hi: jax.Array, index: jax.Array) -> jax.Array:
    """PRNG keys [B] for output token `index` [B] of rows seeded (seed_lo, seed_hi) [B]."""

    def one(lo, hi, i):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(lo), hi), i)

    return jax.vmap(one)(seed_lo, seed_hi, index)


def first_argmax(x: jax.Array) -> jax.Array:
    """jnp.argmax(x, -1) (first index of the maximum) for x [..., V] without NaNs.

    A max and a min over a masked iota: XLA:CPU runs jnp.argmax's variadic
    (value, index) reduce about 3x slower (150 us of a 3 ms decode step at
    [16, 4096], docs/notes/2026-12-02-decode-sampling-and-attention.md).
    """
    m = jnp.max(x, axis=-1, keepdims=True)
    V = x.shape[-1]
    idx = jnp.min(jnp.where(x == m, jnp.arange(V, dtype=jnp.int32), V), axis=-1)
    return jnp.minimum(
        idx, V - 1
    )  # an all-NaN row has no match: clamp like argmax would stay in range


def inverse_cdf_draw(logits: jax.Array, u: jax.Array, *, block: int = 64) -> jax.Array:
    """One token per row from softmax(logits) [B, V] (-inf = excluded) given u [B] in [0, 1).

    Picks the first token whose cumulative probability exceeds u, in two levels
    (the block of `block` tokens, then the token inside it) so no cumsum runs
    over the whole vocabulary. Never returns a token of probability 0: a
    zero-mass block or token never exceeds the running sum, and the fp32
    rounding cases (u * total at or past the last sum) fall to the last block
    / token that has mass. One uniform per row instead of V Gumbel draws: at
    [16, 4096] 0.06 ms against jax.random.categorical's 0.85 ms.
    """
    B, V = logits.shape
    nb = -(-V // block)
    x = jnp.pad(logits.astype(jnp.float32), ((0, 0), (0, nb * block - V)), constant_values=-jnp.inf)
    p = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True)).reshape(B, nb, block)
    mass = p.sum(-1)  # [B, nb]
    cum = jnp.cumsum(mass, axis=-1)
    target = u.astype(jnp.float32) * cum[:, -1]
    last_block = jnp.max(jnp.where(mass > 0, jnp.arange(nb), 0), axis=-1)  # last with mass
    blk = jnp.minimum(jnp.sum(cum <= target[:, None], axis=-1), last_block)
    inner = jnp.take_along_axis(p, blk[:, None, None], axis=1)[:, 0]  # [B, block]
    before = jnp.where(
        blk > 0, jnp.take_along_axis(cum, jnp.maximum(blk - 1, 0)[:, None], axis=1)[:, 0], 0.0
    )
    last_tok = jnp.max(jnp.where(inner > 0, jnp.arange(block), 0), axis=-1)
    j = jnp.minimum(
        jnp.sum(jnp.cumsum(inner, axis=-1) <= (target - before)[:, None], axis=-1), last_tok
    )
    return (blk * block + j).astype(jnp.int32)


def sample_tokens(
    logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One token per row from fp32 logits [B, V], and the log-probs it was drawn from.

    Returns (tokens [B] int32, logp [B, V]): logp is log_softmax of
    `sampling_logits` (temperature, top-k, top-p), the behaviour distribution
    a learner re-scores with the same parameters. Temperature 0 rows take the
    argmax (their logp has no temperature applied; greedy is not a
    distribution RL can train on). Sampled rows draw by `inverse_cdf_draw`
    with one uniform from their key.
    """
    greedy = first_argmax(logits)
    scaled = sampling_logits(logits, temperature, top_k, top_p)
    logp = jax.nn.log_softmax(scaled, axis=-1)

    def sample(_):
        u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
        return jnp.where(temperature > 0, inverse_cdf_draw(scaled, u), greedy)

    # An all-greedy batch skips the noise.
    tok = jax.lax.cond(jnp.any(temperature > 0), sample, lambda _: greedy, None)
    return tok, logp


def unpack_mask(mask: jax.Array, V: int) -> jax.Array:
    """bool [B, V] from bitmask words [B, ceil(V/32)] (bit j of word w: id 32w + j)."""
    ids = jnp.arange(V, dtype=jnp.int32)
    word = jnp.take(mask.astype(jnp.uint32), ids // 32, axis=1)
    return ((word >> (ids % 32).astype(jnp.uint32)) & 1).astype(bool)


@functools.partial(
    jax.jit, static_argnames=("graphdef", "n_steps", "n_top"), donate_argnames=("cache",)
)
def decode_chunk(
    graphdef,
    state,
    cache: KVCache,
    rows: Rows,
    want_top: jax.Array,
    mask: jax.Array | None = None,
    *,
    n_steps: int,
    n_top: int,
):
    """Up to `n_steps` decode steps for all rows; stops early once no row is active.

    mask: None, or uint32 bitmask words [B, ceil(V/32)] of the ids each row's
    next token may take (grammar constraints; all bits set for a free row),
    with n_steps=1: the logits of disallowed ids become -inf before
    `sample_tokens`, so tokens, greedy picks and log-probs are all under the
    mask. None compiles the unmasked chunk as it always was.

    Returns (cache, rows, out) with out = (tokens [n, B] int32, -1 where the row
    emitted nothing; logprobs [n, B] fp32 under the sampling distribution
    (`sample_tokens`); top_ids, top_lps
    [n, B, n_top], zeros unless `want_top`; routing: for a mixture-of-experts
    model (`moe_routing`) the experts each step's input token went to, int32
    [n, B, moe layers, k] (-1 where the row fed nothing), else None).
    """
    if mask is not None and n_steps != 1:
        raise ValueError(f"decode_chunk: a mask holds for one step, got n_steps={n_steps}")
    B = rows.token.shape[0]
    routed = moe_routing(nnx.merge(graphdef, state))
    out0 = (
        jnp.full((n_steps, B), -1, jnp.int32),
        jnp.zeros((n_steps, B), jnp.float32),
        jnp.zeros((n_steps, B, n_top), jnp.int32),
        jnp.zeros((n_steps, B, n_top), jnp.float32),
        None if routed is None else jnp.full((n_steps, B, *routed), -1, jnp.int32),
    )

    def cond(carry):
        i, _, r, _ = carry
        return (i < n_steps) & jnp.any(r.active)

    def body(carry):
        i, cache, r, (o_tok, o_lp, o_tid, o_tlp, o_rt) = carry
        model = nnx.merge(graphdef, state)
        pos = jnp.where(r.active, r.pos, -1)
        logits, cache, *rt = model.decode(
            r.token[:, None], pos[:, None], cache, **adapter_kw(model, r.adapter),
            **({} if o_rt is None else {"return_routing": True}),
        )  # fmt: skip
        if o_rt is not None:  # the experts of the token this step fed (r.token at pos)
            o_rt = o_rt.at[i].set(jnp.where(r.active[:, None, None], rt[0][:, 0], -1))
        keys = row_keys(r.seed_lo, r.seed_hi, r.n_out)
        step_logits = logits[:, 0].astype(jnp.float32)
        if mask is not None:
            allowed = unpack_mask(mask, step_logits.shape[-1])
            step_logits = jnp.where(allowed, step_logits, -jnp.inf)
        tok, logp = sample_tokens(step_logits, keys, r.temperature, r.top_k, r.top_p)
        lp = jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]
        if n_top:
            # Filtered-out candidates are reported at -9999 (finite, JSON-safe).
            t_lp, t_id = jax.lax.cond(
                want_top,
                lambda x: tuple(jax.lax.top_k(jnp.maximum(x, -9999.0), n_top)),
                lambda x: (jnp.zeros((B, n_top), x.dtype), jnp.zeros((B, n_top), jnp.int32)),
                logp,
            )
            o_tid, o_tlp = o_tid.at[i].set(t_id.astype(jnp.int32)), o_tlp.at[i].set(t_lp)
        emit = r.active
        n_out = r.n_out + emit.astype(jnp.int32)
        hit_stop = jnp.any(tok[:, None] == r.stop_ids, axis=-1)
        active = emit & ~hit_stop & (n_out < r.max_out)
        r = r.replace(
            token=jnp.where(emit, tok, r.token),
            pos=r.pos + emit.astype(jnp.int32),
            n_out=n_out,
            active=active,
        )
        o_tok = o_tok.at[i].set(jnp.where(emit, tok, -1))
        o_lp = o_lp.at[i].set(jnp.where(emit, lp, 0.0))
        return i + 1, cache, r, (o_tok, o_lp, o_tid, o_tlp, o_rt)

    _, cache, rows, out = jax.lax.while_loop(cond, body, (jnp.int32(0), cache, rows, out0))
    return cache, rows, out


def moe_routing(model) -> tuple[int, int] | None:
    """(moe layers, k) of a mixture-of-experts model, whose decode can return the
    experts each token went to (`models.moe_decoder`); None for any other model."""
    layers = getattr(model.config, "moe_layers", None)
    if not layers or not hasattr(model, "forward_with_router"):
        return None
    return len(layers), int(model.config.num_experts_per_tok)


def adapter_kw(model, slots: jax.Array) -> dict:
    """`decode`'s adapter_ids for rows of adapter bank slots [B], for a model with a
    bank (`models.lora`, `LoRAConfig.slots`); nothing for any other model."""
    lora = getattr(model.config, "lora", None)
    return {} if lora is None or lora.slots is None else {"adapter_ids": slots}


def prefill_rows(
    graphdef,
    state,
    cache: KVCache,
    row_idx: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    adapters: jax.Array,
) -> tuple[KVCache, jax.Array | None]:
    """Writes prompt tokens into cache rows `row_idx` [b] (index >= B: padding).

    tokens, positions [b, T]; position -1 marks padding; adapters [b]: each
    row's adapter bank slot (0 = the base model; see `adapter_kw`). Only the keys and
    values are kept; the logits of the prompt are not needed (the last prompt
    token is fed by the first decode step, which samples from it). Returns
    (cache, routing): for a mixture-of-experts model (`moe_routing`) the
    experts each prompt token went to, [b, T, moe layers, k]; else None.

    Three jitted calls: `take_rows` and `put_rows` (cheap copies, one compile
    per (B, b, S)) around `prefill_sub`, the model's forward, whose compile
    depends only on (b, T, S) and not on how many rows the cache has. A
    sampler whose row count moves between buckets then compiles each prefill
    shape once, not once per row bucket (the demo's RL compiled new prefill
    shapes at every step: docs/notes/2026-12-02-rl-loop-sampling.md).
    """
    sub, routing = prefill_sub(
        graphdef, state, take_rows(cache, row_idx), tokens, positions, adapters
    )
    return put_rows(cache, row_idx, sub), routing


@jax.jit
def take_rows(cache: KVCache, row_idx: jax.Array) -> KVCache:
    """Cache rows `row_idx` [b] (out of range: empty rows), all slots."""
    return jax.tree.map(lambda x: jnp.take(x, row_idx, axis=0, mode="fill", fill_value=0), cache)


@functools.partial(jax.jit, donate_argnames=("cache",))
def put_rows(cache: KVCache, row_idx: jax.Array, sub: KVCache) -> KVCache:
    """`cache` with rows `row_idx` [b] replaced by `sub`'s (out of range: dropped)."""
    return jax.tree.map(lambda full, part: full.at[row_idx].set(part, mode="drop"), cache, sub)


@functools.partial(jax.jit, donate_argnames=("cache",))
def copy_rows(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
    """`cache` with row dst[i] replaced by row src[i] (all slots) for i < n; dst >= B
    is padding (dropped). src [n], dst [n] int32; no dst row may also be a src
    row. How the sampler shares a prefilled prompt prefix between rows."""
    return jax.tree.map(
        lambda x: x.at[dst].set(jnp.take(x, src, axis=0, mode="clip"), mode="drop"), cache
    )


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("sub",))
def prefill_sub(
    graphdef, state, sub: KVCache, tokens: jax.Array, positions: jax.Array, adapters: jax.Array
) -> tuple[KVCache, jax.Array | None]:
    """The prompt tokens [b, T] written into a [b]-row cache, and their routing
    (see `prefill_rows`)."""
    model = nnx.merge(graphdef, state)
    first = jnp.zeros(tokens.shape[:1], jnp.int32)
    kw = adapter_kw(model, adapters)
    if moe_routing(model) is None:
        return model.decode(tokens, positions, sub, logits_at=first, **kw)[1], None
    _, sub, routing = model.decode(
        tokens, positions, sub, logits_at=first, return_routing=True, **kw
    )
    return sub, routing


@functools.partial(jax.jit, static_argnames=("max_len",))
def resize_cache(cache: KVCache, row_idx: jax.Array, *, max_len: int) -> KVCache:
    """New cache whose row i is old row `row_idx[i]` (out of range: empty), for `max_len`
    positions. A sliding-window cache keeps at most its window of slots: a row's
    positions below both sizes sit in the same slots either way (p mod window = p).
    A cache made of several `KVCache`s (Gemma 3's `HybridCache`: a ring for its sliding
    layers, full length for the others) resizes each one by its own window."""
    return jax.tree.map(
        lambda c: _resize(c, row_idx, max_len), cache, is_leaf=lambda x: isinstance(x, KVCache)
    )


def _resize(cache: KVCache, row_idx: jax.Array, max_len: int) -> KVCache:
    ax = cache.seq_axis
    want = KVCache.slots_for(max_len, cache.window)

    def one(x):
        x = jnp.take(x, row_idx, axis=0, mode="fill", fill_value=0)
        S = x.shape[ax]
        if want >= S:
            return jnp.pad(x, [(0, want - S) if i == ax else (0, 0) for i in range(x.ndim)])
        return jax.lax.slice_in_dim(x, 0, want, axis=ax)

    out = jax.tree.map(one, cache)
    return out if cache.window is None else out.replace(length=max_len)
