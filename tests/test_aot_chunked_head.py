"""The chunked log-prob loop compiled for a TPU topology (v5e:2x2) on this CPU host:
with the output head split over fsdp (FSDP), the head is all-gathered ONCE before the
chunk loop and its gradient reduced once after it, never inside the loop (issue 69:
left to XLA, Qwen3-8B's 1.24 GB head was gathered twice and its gradient all-reduced
in each of 256 trips, ~975 GB of a step's 1,007 GB of collectives). Skipped only where
libtpu is not installed (the [tpu-aot] extra, in [dev])."""

import os

import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
pytest.importorskip("libtpu", reason="the AOT tests need libtpu (pip install -e .[tpu-aot])")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from ac2_jax import aot  # noqa: E402
from ac2_jax.losses import LMHead, chunked_token_logprobs  # noqa: E402

R, L, D, V, CHUNK = 8, 64, 128, 512, 8  # 8 trips of the chunk loop


def test_the_fsdp_head_is_gathered_once_outside_the_chunk_loop():
    mesh = Mesh(np.asarray(aot.topology_devices("v5e:2x2")).reshape(1, 4), ("data", "fsdp"))
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    h = jax.ShapeDtypeStruct((R, L, D), jnp.bfloat16, sharding=rows)
    w = jax.ShapeDtypeStruct((D, V), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    targets = jax.ShapeDtypeStruct((R, L), jnp.int32, sharding=rows)

    def loss(h, w, targets):
        return -jnp.sum(chunked_token_logprobs(h, LMHead(w), targets, chunk_size=CHUNK))

    with jax.set_mesh(mesh):
        hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(h, w, targets).compile().as_text()
    found = aot.collectives(hlo)
    head = [c for c in found if sorted(c["shape"]) == sorted([D, V])]
    assert {c["kind"] for c in head} >= {"all-gather"}, found
    # the gather (bf16 or fp32) and the gradient's reduction each run once a step
    assert [c["times"] for c in head] == [1] * len(head), head
    # nothing inside the 8-trip loop moves more than a chunk's rows
    assert all(c["times"] == 1 for c in found if c["bytes"] >= D * V), found
