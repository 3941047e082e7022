"""The TPU attention kernel ("pallas_tpu") compiled ahead of time for a TPU topology on
this CPU host (libtpu, `jax.experimental.topologies`), at a real model's attention
shape: per row kind (flat packed rows, a tree row), the forward and the forward +
backward, with XLA's memory and cost analyses and the share of (q, k) tiles the
kernel computes (`AttentionMask.tiles`; the rest it skips).

    python -m experiments.attention_tpu_aot --topology v5p:2x2x1 --length 8192

Shape: Qwen3-8B's attention (32 query heads, 8 kv heads, head_dim 128), bf16, one
row of `--length` tokens on one chip. Rows: flat = 4 segments of length / 4;
tree = a prefix of length / 4 and 4 branches of 3 * length / 16 each (DFS layout).
The flops are the kernel's cost estimate, every tile counted (an upper bound).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ac2_jax.models import AttentionMask  # noqa: E402
from ac2_jax.models.kernels.attention_tpu import pallas_tpu_attention  # noqa: E402


def rows(length: int) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    """{kind: (segment_ids [1, L], subtree_end [1, L] or None)}."""
    q = length // 4
    flat = np.repeat(np.arange(1, 5), q)[None]
    end = np.arange(length)
    end[:q] = length - 1
    b = 3 * length // 16
    for i in range(4):
        end[q + i * b : q + (i + 1) * b] = q + (i + 1) * b - 1
    seg = (np.arange(length) < q + 4 * b).astype(np.int32)[None]
    end = np.where(seg[0] > 0, end, np.arange(length))
    return {"flat": (flat.astype(np.int32), None), "tree": (seg, end[None].astype(np.int32))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topology", default="v5p:2x2x1")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--block", type=int, default=512)
    a = p.parse_args()
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(platform="tpu", topology_name=a.topology).devices
    one = jax.sharding.SingleDeviceSharding(devices[0])
    H, K, hd, L = 32, 8, 128, a.length
    spec = lambda s, d=jnp.bfloat16: jax.ShapeDtypeStruct(s, d, sharding=one)  # noqa: E731
    print(f"{a.topology} ({devices[0].device_kind}), L={L}, H={H}, K={K}, hd={hd}, block {a.block}")
    for kind, (seg, end) in rows(L).items():
        mask = AttentionMask.packed(jnp.asarray(seg), None if end is None else jnp.asarray(end))
        rows_ = (H // K) * L  # the kernel's GQA-folded query rows per kv head
        tiles = mask.tiles(a.block, a.block)
        share = float(tiles.mean())
        tree = end is not None

        def loss(q, k, v, seg, end, tree=tree):
            m = AttentionMask.packed(seg, end if tree else None)
            out = pallas_tpu_attention(q, k, v, m, block_q=a.block, block_k=a.block)
            return jnp.sum(out.astype(jnp.float32))

        args = (spec((1, L, H, hd)), spec((1, L, K, hd)), spec((1, L, K, hd)),
                spec((1, L), jnp.int32), spec((1, L), jnp.int32))  # fmt: skip
        for name, fn in (("forward", loss), ("fwd+bwd", jax.grad(loss, argnums=(0, 1, 2)))):
            t = time.perf_counter()
            compiled = jax.jit(fn).lower(*args).compile()
            secs = time.perf_counter() - t
            mem, cost = compiled.memory_analysis(), compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            print(
                f"  {kind:4s} {name:8s} tiles computed {share:.0%} (of the row's "
                f"{tiles.size} {a.block}x{a.block} tiles; {rows_} folded query rows); "
                f"compile {secs:.1f} s; args {mem.argument_size_in_bytes / 2**20:.0f} MiB, "
                f"temp {mem.temp_size_in_bytes / 2**20:.0f} MiB, "
                f"out {mem.output_size_in_bytes / 2**20:.0f} MiB; "
                f"flops (every tile) {cost.get('flops', 0) / 1e12:.2f} T"
            )


if __name__ == "__main__":
    main()
