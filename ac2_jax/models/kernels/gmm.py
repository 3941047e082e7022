"""The experts' grouped GEMM on TPU: Pallas megablox `gmm` (the MoE layer's "gmm" grouped
matmul, `models.moe.grouped_matmul_for`; elsewhere `jax.lax.ragged_dot`). On CPU it runs
in interpret mode (tests)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def gmm(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, interpret: bool) -> jax.Array:
    """megablox `gmm` (differentiable) of lhs [M, K] by rhs [E, K, N] in groups of
    `sizes` rows, in lhs's dtype (fp32 accumulation). Rows are padded to the m tile
    and every row is put in a group (the tail in the last one), so no output or
    gradient row is left uninitialised; the caller masks the rows of no expert."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm

    m = lhs.shape[0]
    tm = min(128, -(-m // 8) * 8)
    mp = -(-m // tm) * tm
    sizes = sizes.at[-1].add(mp - jnp.sum(sizes))
    # k and n tiles of 128 whatever the widths (gmm masks a ragged last tile): the
    # backward reuses this tiling with k and n swapped, so neither may be a width
    tiling = (tm, 128, 128)
    lhs = jnp.pad(lhs, ((0, mp - m), (0, 0)))
    out = megablox_gmm(
        lhs, rhs.astype(lhs.dtype), sizes, lhs.dtype, tiling, None, None, False, interpret
    )
    return out[:m]
