"""Mixture of experts vs dense: forward + backward time side by side (issue 34).

One run times, on the same tokens, a jitted forward + backward (cross-entropy of
random targets, gradients of every param) of:

* ``dense``: the decoder (`Decoder`) whose MLP has the MoE's active width
  (intermediate_size = k x moe_intermediate_size): the same active parameters
  per token, up to the router;
* ``moe_ragged``: `MoEDecoder`, dropless: tokens sorted by expert, one
  `jax.lax.ragged_dot` per projection (the default);
* ``moe_capacity``: the same with ``--capacity`` (one batched matmul over
  [E, C, D] buffers; overflow dropped and counted, reported as ``dropped``);
* ``moe_all_experts``: a dense reference that runs every expert on every token
  ([T, E, F]) and weights the k chosen, the cost grouped GEMMs avoid;

each with its time over ``dense`` (``x_dense``). ``replay`` reports the
routing-replay figures: a bf16 sampler (prefill through the cache, routing
recorded) against the fp32 learner with the same weights: how many tokens
route elsewhere, and |learner - sampler| log-prob of the sampled tokens with
the learner's own routing (recompute) and with the sampler's (replay).

On XLA:CPU `ragged_dot` lowers to a masked dense matmul over all groups (E
times the work; a GPU / TPU runs grouped GEMMs), so on CPU ``moe_ragged`` is
close to ``moe_all_experts``; ``moe_capacity`` is the CPU-friendly form.

    python -m benchmarks.bench_moe --tokens 2048 --out bench_results/moe.json
    python -m benchmarks.bench_moe --tokens 64 --hidden 32 --repeats 1   (smoke)
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.common import machine, parser, print_table, time_fn, write_json  # noqa: E402

CASES = ("dense", "moe_ragged", "moe_capacity", "moe_all_experts", "replay")


def all_experts(x, ids, weights, real, wg, wu, wd, capacity_factor=None, grouped="ragged_dot"):
    """The dense reference of `models.moe.experts_apply`: every expert on every token.

    Same signature; `capacity_factor` and `grouped` (the dropless path's grouped GEMM)
    choose how the sparse path computes, and this reference has no sparse path."""
    del capacity_factor, grouped
    E = wg.shape[0]
    gates = jnp.zeros((x.shape[0], E), x.dtype)
    gates = gates.at[jnp.arange(x.shape[0])[:, None], ids].add(weights.astype(x.dtype))
    gates = jnp.where(real[:, None], gates, 0)
    h = jax.nn.silu(jnp.einsum("nd,edf->nef", x, wg)) * jnp.einsum("nd,edf->nef", x, wu)
    y = jnp.einsum("nef,efd,ne->nd", h, wd, gates)
    sizes = jnp.zeros((E,), jnp.int32).at[ids.reshape(-1)].add(1)
    return y, sizes, jnp.zeros((), jnp.int32)


def _configs(args):
    from ac2_jax.models import DecoderConfig
    from ac2_jax.models.moe import MoEDecoderConfig

    shared = dict(
        vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=args.heads, num_kv_heads=max(1, args.heads // 4),
        head_dim=args.hidden // args.heads, tie_embeddings=True, scan_layers=True, remat="none",
        attention_backend="dense",
    )  # fmt: skip
    dense = DecoderConfig(intermediate_size=args.k * args.moe_ffn, family="qwen3", **shared)
    moe = MoEDecoderConfig.tiny(
        **shared, intermediate_size=args.k * args.moe_ffn, num_experts=args.experts,
        num_experts_per_tok=args.k, moe_intermediate_size=args.moe_ffn, mlp_only_layers=(),
    )  # fmt: skip
    return dense, moe


def _count(model) -> int:
    return int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def _fwd_bwd(model, tokens, targets):
    graphdef, params = nnx.split(model, nnx.Param)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    seg = jnp.ones_like(tokens)

    def loss(p):
        logits = nnx.merge(graphdef, p)(tokens, pos, seg)
        lp = jax.nn.log_softmax(logits, -1)
        return -jnp.mean(jnp.take_along_axis(lp, targets[..., None], -1))

    step = jax.jit(jax.value_and_grad(loss))
    return lambda: jax.block_until_ready(step(params))


def _dropped(model, tokens) -> int:
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    run = nnx.jit(lambda m, t: m.forward_with_router(t, pos, jnp.ones_like(t))[1].dropped)
    return int(np.asarray(run(model, tokens)).sum())


def replay_figures(moe_config, tokens) -> dict:
    """bf16 sampler vs fp32 learner, same weights: routing flips and log-prob gaps."""
    from ac2_jax.models import build_model

    learner = build_model(moe_config.replace(scan_layers=False), nnx.Rngs(0))
    graphdef, params, rest = nnx.split(learner, nnx.Param, ...)
    bf16 = moe_config.replace(scan_layers=False, dtype=jnp.bfloat16)
    sampler = nnx.merge(nnx.graphdef(build_model(bf16)), params, rest)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)

    @nnx.jit
    def sample(m):
        cache = m.init_cache(*tokens.shape)
        return m.decode(tokens, pos, cache, return_routing=True)

    @nnx.jit
    def learn(m, routing=None):
        h, st = m.forward_with_router(tokens, pos, jnp.ones_like(tokens), routing=routing)
        return m.logits(h), st.experts

    def token_lp(logits):
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)[:, :-1]
        return np.asarray(jnp.take_along_axis(lp, tokens[:, 1:, None], -1)[..., 0])

    s_logits, _, recorded = sample(sampler)
    want = token_lp(s_logits)
    own_logits, own = learn(learner)
    rep_logits, _ = learn(learner, recorded)
    flipped = np.any(np.sort(np.asarray(own), -1) != np.sort(np.asarray(recorded), -1), (-1, -2))
    d_own, d_rep = np.abs(token_lp(own_logits) - want), np.abs(token_lp(rep_logits) - want)
    after = np.cumsum(flipped, axis=1)[:, :-1] > 0  # predictions at or after a flip
    return {
        "case": "replay", "tokens_flipped": float(flipped.mean()),
        "recompute_max": float(d_own.max()), "recompute_mean": float(d_own.mean()),
        "replay_max": float(d_rep.max()), "replay_mean": float(d_rep.mean()),
        "recompute_mean_after_flip": float(d_own[after].mean()) if after.any() else 0.0,
        "replay_mean_after_flip": float(d_rep[after].mean()) if after.any() else 0.0,
    }  # fmt: skip


def main(argv=None) -> list[dict]:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=1024, help="tokens per step (one row)")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--moe_ffn", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--capacity", type=float, default=1.25)
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    from ac2_jax.models import build_model, moe_decoder

    dense_cfg, moe_cfg = _configs(args)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, args.vocab, (args.rows, args.tokens)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, args.vocab, (args.rows, args.tokens)), jnp.int32)
    rows, base = [], None
    for case in cases:
        if case == "replay":
            rows.append(replay_figures(moe_cfg, tokens))
            continue
        config = {
            "dense": dense_cfg, "moe_ragged": moe_cfg, "moe_all_experts": moe_cfg,
            "moe_capacity": moe_cfg.replace(capacity_factor=args.capacity),
        }[case]  # fmt: skip
        model = build_model(config, nnx.Rngs(0))
        original = moe_decoder.experts_apply
        if case == "moe_all_experts":
            moe_decoder.experts_apply = all_experts  # type: ignore[assignment]
        try:
            t = time_fn(_fwd_bwd(model, tokens, targets), repeats=args.repeats)
            dropped = _dropped(model, tokens) if case != "dense" else 0
        finally:
            moe_decoder.experts_apply = original
        active = _count(model)
        if case != "dense":  # the experts a token does not use
            E, k, F, D = args.experts, args.k, args.moe_ffn, args.hidden
            active -= args.layers * (E - k) * 3 * D * F
        row = {"case": case, "params": _count(model), "active_params": active,
               "fwd_bwd_s": t["median_s"], "dropped": dropped}  # fmt: skip
        base = row["fwd_bwd_s"] if case == "dense" else base
        row["x_dense"] = row["fwd_bwd_s"] / base if base else None
        rows.append(row)
    timed = [r for r in rows if r["case"] != "replay"]
    if timed:
        print_table(timed, ["case", "params", "active_params", "fwd_bwd_s", "x_dense", "dropped"])
    for r in rows:
        if r["case"] == "replay":
            print({k: round(v, 5) if isinstance(v, float) else v for k, v in r.items()})
    print(machine())
    write_json(args.out, {"args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
