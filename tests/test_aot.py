"""Ahead-of-time compilation for a TPU topology on this CPU host (`python -m ac2_jax.aot`):
the tiny model's RL train step and the sampler's decode chunk lower and compile for
v5e:2x2 with libtpu, so a change that breaks the TPU lowering fails here; the
collectives reader counts a collective inside a scan trip-count times and finds a
whole weight stack gathered at once. Skipped only where libtpu is not installed
(the [tpu-aot] extra, in [dev])."""

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

TOPOLOGY = "v5e:2x2"


@pytest.fixture(scope="module")
def devices():
    return aot.topology_devices(TOPOLOGY)


def test_tiny_rl_step_and_decode_chunk_compile_for_v5e(capsys):
    """One RL step (PPO, chunked log-probs, scan + remat, the Pallas attention kernel)
    on an fsdp=4 mesh and one decode chunk of the sampler, compiled for 4 v5e chips:
    the table's rows, their memory within the chip's HBM, and the FSDP all-gathers
    inside the layer scan."""
    plan = aot.build_plan([
        f"--topology={TOPOLOGY}", "--model=tiny", "--recipe=rl", "--seq-len=128", "--batch=4",
        "--programs=train,decode", "--sampler-batch=4", "--sampler-len=128",
    ])  # fmt: skip
    report = aot.run(plan)
    out = capsys.readouterr().out
    rows = {r["program"]: r for r in report["programs"]}
    assert set(rows) == {"train", "decode"}
    assert dict(report["mesh"]) == {"data": 1, "fsdp": 4, "tensor": 1}
    train = rows["train"]
    assert train["facts"]["tokens"] == 4 * 128 and train["facts"]["loss"] == "PolicyGradientLoss"
    mem = train["analysis"]["memory"]
    assert 0 < mem["argument"] and mem["peak"] <= 16 * aot.GiB and train["analysis"]["fits"]
    # FSDP: the scanned weights are gathered a layer at a time inside the scan (2 layers).
    gathers = train["analysis"]["collectives"]["all-gather"]
    assert gathers["runs"] > gathers["count"]
    assert report["whole_stack_all_gathers"] == []
    # attention "auto" under the TPU mesh is the Pallas kernel (forward, dq, dk/dv)
    assert train["analysis"]["tpu_kernels"] >= 3 and rows["decode"]["analysis"]["tpu_kernels"] >= 1
    assert rows["decode"]["facts"]["steps"] == 8
    assert 0 < train["roofline"]["mfu"] <= 1
    assert "train" in out and "decode" in out and "MFU" in out


def test_collectives_inside_a_scan_count_their_trips_and_a_whole_stack_gather_is_found(devices):
    """A scanned stack of 6 weights [6, 256, 512] split over 4 chips: gathered a
    layer at a time, the all-gather runs 6 times per call, 256x512 bf16 each;
    constrained to replicated before the scan, it is one [6, 256, 512] gather,
    which `whole_stack_gathers` reports."""
    mesh = Mesh(np.asarray(devices).reshape(4), ("fsdp",))
    w = jax.ShapeDtypeStruct((6, 256, 512), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(None, "fsdp")))  # fmt: skip
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P()))

    def layered(w, x):
        def body(h, wl):
            wl = jax.lax.with_sharding_constraint(wl, NamedSharding(mesh, P()))
            return jnp.tanh(h @ wl)[:, :256], None

        return jax.lax.scan(body, x, w)[0]

    def whole(w, x):
        w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))
        return jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl)[:, :256], None), x, w)[0]

    per_layer = 256 * 512 * 2
    found = aot.collectives(jax.jit(layered).lower(w, x).compile().as_text())
    gathers = [c for c in found if c["kind"] == "all-gather"]
    assert [(c["times"], c["bytes"]) for c in gathers] == [(6, per_layer)]
    assert aot.collective_summary(found)["all-gather"]["bytes"] == 6 * per_layer
    assert aot.whole_stack_gathers(found, 6, per_layer) == []
    found = aot.collectives(jax.jit(whole).lower(w, x).compile().as_text())
    stack = aot.whole_stack_gathers(found, 6, per_layer)
    assert [(c["times"], c["bytes"]) for c in stack] == [(1, 6 * per_layer)]


def test_bad_topology_and_flags_are_one_line_errors(capsys):
    assert aot.main(["--topology=v9z:2x2", "--model=tiny"]) == 2
    assert "--topology='v9z:2x2'" in capsys.readouterr().err
    assert aot.main(["--topology=v5e:2x2", "--model=tiny", "--seqlen=5"]) == 2
    assert "did you mean --seq-len" in capsys.readouterr().err
    assert aot.main(["--topology=v5e:2x2", "--model=qwen3-9b"]) == 2
    assert "qwen3-8b" in capsys.readouterr().err
