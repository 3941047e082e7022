"""Why a decode step at batch 8-16 is slow on a small CPU share: its working set.

Two measurements in one process (min over rounds; the attention forms alternate):

1. `gemm`: a dependent chain of MLP-shaped products, x <- x + tanh(x @ U) @ D with
   U [256, 768] and D [768, 256] (bench_sampler's model's MLP), M = batch rows, for a
   few total weight sizes: a chain whose weights fit in the cache a core sees, and one
   past it (the sampler's decode step reads its 21 MB of weights and the KV cache
   every step). XLA (one jit) against numpy's OpenBLAS, GFLOP/s each; each library's
   rounds run apart (XLA's first), as OpenBLAS's idle threads spin on the cores.
2. `attention`: one decode step's attention over a [B, K, S, hd] cache, 4 layers in one
   jit (bench_sampler's model: 4 KV heads of 2 queries, hd 32): the library's two
   einsums (`_decode_step_attention`), broadcast-multiply-reduce forms, and the
   key cache stored transposed ([B, K, hd, S]); results checked equal (2e-4).
   GB/s is the cache's bytes over the time.

    python -m benchmarks.bench_decode_working_set --out bench_results/decode_ws.json
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import parser, print_table, write_json

NEG = -1e30


def _min_us(fns: dict, rounds: int, inner: int) -> dict[str, float]:
    """{name: min microseconds per call} over `rounds` alternating rounds."""
    for f in fns.values():
        f()
    best = {k: math.inf for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            best[k] = min(best[k], (time.perf_counter() - t0) / inner * 1e6)
    return best


def gemm_rows(batches, weight_mb, rounds: int = 5, inner: int = 5) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for mb in weight_mb:
        layers = max(1, round(mb * 2**20 / (2 * 256 * 768 * 4)))
        U = [rng.standard_normal((256, 768), np.float32) / 16 for _ in range(layers)]
        D = [rng.standard_normal((768, 256), np.float32) / 28 for _ in range(layers)]
        jU, jD = [jnp.asarray(u) for u in U], [jnp.asarray(d) for d in D]

        @jax.jit
        def chain(x, Us, Ds):
            for u, d in zip(Us, Ds, strict=True):
                x = x + jnp.tanh(x @ u) @ d
            return x

        def np_chain(x, U=U, D=D):
            for u, d in zip(U, D, strict=True):
                x = x + np.tanh(x @ u) @ d
            return x

        for b in batches:
            x = rng.standard_normal((b, 256), np.float32)
            jx = jnp.asarray(x)
            np.testing.assert_allclose(np.asarray(chain(jx, jU, jD)), np_chain(x), rtol=1e-3,
                                       atol=1e-3)
            # Not alternated: OpenBLAS's threads spin for a while after each call and take
            # the cores XLA's next call needs (BUILD_NOTES "OpenBLAS inside XLA:CPU").
            xla = lambda c=chain, a=(jx, jU, jD): c(*a).block_until_ready()  # noqa: E731
            t = {**_min_us({"xla": xla}, rounds, inner),
                 **_min_us({"numpy": lambda f=np_chain, a=x: f(a)}, rounds, inner)}
            flops = 2 * b * 256 * 768 * 2 * layers
            rows.append({"case": "gemm", "batch": b, "weights_mb": 2 * layers * 0.75,
                         "xla_us": t["xla"], "numpy_us": t["numpy"],
                         "xla_gflops": flops / t["xla"] / 1e3,
                         "numpy_gflops": flops / t["numpy"] / 1e3})
    return rows


def _scores(q, k, form):
    if form == "einsum":
        return jnp.einsum("bkgd,bksd->bkgs", q, k, preferred_element_type=jnp.float32)
    if form == "reduce":
        return jnp.sum(q[:, :, :, None, :] * k[:, :, None, :, :], -1)
    if form == "einsum_kT":  # k [B, K, hd, S]
        return jnp.einsum("bkgd,bkds->bkgs", q, k, preferred_element_type=jnp.float32)
    return jnp.sum(q[..., None] * k[:, :, None], -2)  # reduce_kT


def _values(p, v, form):
    if form == "einsum":
        return jnp.einsum("bkgs,bksd->bkgd", p, v)
    return jnp.sum(p[..., None] * v[:, :, None], -2)


FORMS = {  # name: (scores form, values form, keys transposed)
    "library (einsums)": ("einsum", "einsum", False),
    "reduce / reduce": ("reduce", "reduce", False),
    "einsum, keys [hd, S]": ("einsum_kT", "einsum", True),
    "reduce, keys [hd, S]": ("reduce_kT", "reduce", True),
}


def attention_rows(batches, slots: int, rounds: int = 5, inner: int = 20) -> list[dict]:
    K, G, hd, L = 4, 2, 32, 4
    rows = []
    for b in batches:
        rng = np.random.default_rng(0)
        ks = [rng.standard_normal((b, K, slots, hd), np.float32) for _ in range(L)]
        kts = [jnp.asarray(k.transpose(0, 1, 3, 2).copy()) for k in ks]
        ks = [jnp.asarray(k) for k in ks]
        vs = [jnp.asarray(rng.standard_normal((b, K, slots, hd), np.float32)) for _ in range(L)]
        q = jnp.asarray(rng.standard_normal((b, K, G, hd), np.float32))
        mask = jnp.arange(slots)[None, :] <= jnp.full((b, 1), slots * 3 // 5)
        fns, outs = {}, {}
        for name, (sf, vf, tr) in FORMS.items():

            @jax.jit
            def run(q, keys, vs, mask, sf=sf, vf=vf):
                for layer in range(L):
                    s = _scores(q, keys[layer], sf) / math.sqrt(hd)
                    p = jax.nn.softmax(jnp.where(mask[:, None, None, :], s, NEG), -1)
                    q = _values(p, vs[layer], vf) * 0.5 + q
                return q

            keys = kts if tr else ks
            outs[name] = np.asarray(run(q, keys, vs, mask))
            fns[name] = lambda run=run, a=(q, keys, vs, mask): run(*a).block_until_ready()
        for name in FORMS:
            np.testing.assert_allclose(outs[name], outs["library (einsums)"], rtol=2e-4,
                                       atol=2e-4)
        t = _min_us(fns, rounds, inner)
        mb = 2 * L * b * K * slots * hd * 4 / 2**20
        for name, us in t.items():
            rows.append({"case": "attention", "batch": b, "slots": slots, "form": name,
                         "cache_mb": mb, "us": us, "gb_s": mb / 1024 / us * 1e6})
    return rows


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--batches", default="8,16")
    p.add_argument("--weight_mb", default="6,18,36", help="total weights of each gemm chain")
    p.add_argument("--slots", type=int, default=512, help="KV cache slots")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    a = attention_rows(batches, args.slots, args.rounds)  # first: no OpenBLAS threads yet
    g = gemm_rows(batches, [float(x) for x in args.weight_mb.split(",")], args.rounds)
    print_table(g, ["batch", "weights_mb", "xla_us", "xla_gflops", "numpy_us", "numpy_gflops"])
    print_table(a, ["batch", "slots", "form", "cache_mb", "us", "gb_s"])
    write_json(args.out, {"benchmark": "decode_working_set", "config": vars(args),
                          "gemm": g, "attention": a})
    return g, a


if __name__ == "__main__":
    main()
