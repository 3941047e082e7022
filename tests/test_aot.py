"""Ahead-of-time compilation for a TPU topology on this CPU host (`python -m ac2_jax.aot`):
the tiny model's RL train step and the sampler's decode chunk lower and compile for
v5e:2x2 with libtpu, so a change that breaks the TPU lowering fails here; the
collectives reader counts a collective inside a scan trip-count times and finds a
whole weight stack gathered at once. Skipped only where libtpu is not installed
(the [tpu-aot] extra, in [dev])."""

import json
import os
import sys

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
# The smallest MoE that exercises every TPU kernel the train step can hold: 2 scanned
# layers (an FSDP gather per layer inside the scan), 4 experts top-2 (megablox gmm and
# tgmm), head_dim 16, vocab 128.
TINY_MOE = {"model_type": "qwen3_moe", "vocab_size": 128, "hidden_size": 64,
            "intermediate_size": 128, "moe_intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 1024,
            "tie_word_embeddings": True}  # fmt: skip


@pytest.fixture(scope="module")
def devices():
    return aot.topology_devices(TOPOLOGY)


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    """One RL step and one decode chunk of the tiny MoE, compiled once for the module."""
    import contextlib
    import io

    path = tmp_path_factory.mktemp("aot") / "config.json"
    path.write_text(json.dumps(TINY_MOE))
    plan = aot.build_plan([
        f"--topology={TOPOLOGY}", f"--model={path}", "--recipe=rl", "--seq-len=128",
        "--batch=4", "--programs=train,decode", "--sampler-batch=4", "--sampler-len=128",
        "--config.rl.moe.routing=replay", "--rules=expert=fsdp",
    ])  # fmt: skip
    # Blocks of 64 (a valid DecoderConfig.attention_block) must be rounded up to Mosaic's
    # 128 lanes on TPU: unrounded they failed to lower (3ea77aa).
    plan.model = plan.model.replace(attention_block=64)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        report = aot.run(plan)
    return report, out.getvalue()


@pytest.mark.full  # an ahead-of-time compile for a TPU topology through libtpu (~13 s)
def test_tiny_rl_step_and_decode_chunk_compile_for_v5e(tiny_report):
    """One RL step (PPO, chunked log-probs, scan + remat, routing replay, the Pallas
    attention kernel at blocks of 64, the experts through gmm) on an fsdp=4 mesh and
    one decode chunk of the sampler, compiled for 4 v5e chips: the table's rows, their
    memory within the chip's HBM, the FSDP all-gathers inside the layer scan, and the
    TPU kernels' lowering (attention forward, dq, dk/dv; gmm and tgmm: Mosaic's block
    rules are only checked by a TPU compile; this is the suite's guard for them)."""
    report, out = tiny_report
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
    # attention "auto" under the TPU mesh is the Pallas kernel; the experts run through gmm
    kernels = train["analysis"]["kernel_names"]
    assert {"gmm", "tgmm"} <= set(kernels), kernels
    for kernel in ("attention_fwd", "attention_dq", "attention_dkv"):
        assert any(k.endswith(kernel) for k in kernels), (kernel, kernels)
    assert rows["decode"]["analysis"]["tpu_kernels"] >= 1
    assert rows["decode"]["facts"]["steps"] == 8
    assert 0 < train["roofline"]["mfu"] <= 1
    assert "train" in out and "decode" in out and "MFU" in out
    # --json's report is plain JSON (no object needing default=str)
    assert json.loads(json.dumps(report)) == report


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
    # distill is refused for what it lacks; a misspelt recipe gets the nearest name
    assert aot.main(["--topology=v5e:2x2", "--model=tiny", "--recipe=distill"]) == 2
    err = capsys.readouterr().err
    assert "--recipe='distill'" in err and "--recipe=rl or --recipe=sft" in err, err
    assert aot.main(["--topology=v5e:2x2", "--model=tiny", "--recipe=sf"]) == 2
    err = capsys.readouterr().err
    assert "did you mean --recipe=sft" in err and "distill" not in err, err


def test_config_fields_the_command_does_not_compile_are_refused(capsys):
    """Every --config.FIELD either shapes a compiled program or is refused by name: the
    sampler, rollout, eval, log and alarm sections (and sft.layout / truncate) do not
    reach the compiled step; --sampler-len / --sampler-batch size the sampler."""
    base = ["--topology=v5e:2x2", "--model=tiny"]
    for field in ("sampler.max_context=4096", "rollout.temperature=0.5", "alarms.enabled=false",
                  "rl.compile_ahead=false"):  # fmt: skip
        assert aot.main([*base, f"--config.{field}"]) == 2, field
        err = capsys.readouterr().err
        assert f"--config.{field.split('=')[0]}" in err and "not compiled" in err, err
    assert aot.main([*base, "--recipe=sft", "--config.sft.layout=tree"]) == 2
    assert "--config.sft.layout" in capsys.readouterr().err
    plan = aot.build_plan([*base, "--config.rl.loss.chunk_size=64", "--config.mesh.fsdp=4",
                           "--config.rl.optimizer.learning_rate=1e-5"])  # fmt: skip
    assert plan.config.rl.loss.chunk_size == 64 and dict(plan.mesh.shape)["fsdp"] == 4


def test_model_flops_count_the_matmuls_a_token_passes_through():
    """6 N T (+ causal attention: PaLM's 12 L H hd S per token, halved) with N the
    params of the matmuls: an
    untied model's input embedding is a lookup, not a matmul (MaxText's and PaLM's
    convention: the embedding counted once, as the output head); a tied one's single
    table is the head's matmul."""
    from ac2_jax.models.family import config_from_hf
    from ac2_jax.models.presets import shape_config

    for name, tied in (("qwen3-8b", False), ("qwen3-0.6b", True)):
        config = config_from_hf(shape_config(name))
        total = aot.n_params(config)
        embed = config.vocab_size * config.hidden_size
        matmul = total - (0 if tied else embed)
        T, S = 8 * 8192, 8192
        attn = 6 * T * S * config.num_heads * config.head_dim * config.num_layers
        got = aot.model_flops(config, T, S, True, aot.active_params(config, total))
        assert got == pytest.approx(6 * matmul * T + attn, rel=1e-12), name


def test_presets_are_the_published_models_parameter_for_parameter():
    """Each preset's parameter count equals transformers' own model built from the
    preset's config class on the meta device (no weights, nothing downloaded), and the
    model cards' rounded totals (Qwen3-30B-A3B: 30.5B total, 3.3B activated)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from ac2_jax.models.family import config_from_hf
    from ac2_jax.models.presets import SHAPES, shape_config, shape_kwargs

    card = {"qwen3-0.6b": 0.6e9, "qwen3-1.7b": 1.7e9, "qwen3-4b": 4.0e9, "qwen3-8b": 8.2e9,
            "qwen3-30b-a3b": 30.5e9, "gemma3-1b": 1.0e9, "llama-3.2-1b": 1.24e9,
            "llama-3.1-8b": 8.03e9}  # fmt: skip
    assert sorted(card) == sorted(SHAPES.names())
    for name, published in card.items():
        cls, kwargs = shape_kwargs(name)
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kwargs))
        config = config_from_hf(shape_config(name))
        ours = aot.n_params(config)
        assert ours == sum(p.numel() for p in hf.parameters()), name
        assert ours == pytest.approx(published, rel=0.03), name
        if name == "qwen3-30b-a3b":
            assert aot.active_params(config, ours) == pytest.approx(3.3e9, rel=0.03)


def test_missing_libtpu_is_one_line_naming_the_extra(monkeypatch, capsys):
    """Without libtpu the command stops with one line naming the [tpu-aot] extra."""
    monkeypatch.setitem(sys.modules, "libtpu", None)  # import libtpu now fails as if absent
    assert aot.main(["--topology=v5e:2x2", "--model=tiny"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "libtpu" in err and "ac2_jax[tpu-aot]" in err, err


def test_chip_figures_are_the_cited_tables():
    """Per chip, from the Cloud TPU pages' tables (aot's docstring): ICI is the table's
    bidirectional per-chip bandwidth over 2 (one direction, what a chip receives)."""
    GB = 1e9
    want = {"v5e": (16, 197e12, 819 * GB, 400 * GB / 2),
            "v5p": (95, 459e12, 2765 * GB, 1200 * GB / 2),
            "v6e": (32, 918e12, 1638 * GB, 800 * GB / 2)}  # fmt: skip
    for name, (hbm, peak, hbm_bw, ici) in want.items():
        c = aot.CHIPS[name]
        assert (c.hbm_bytes, c.peak_bf16_flops, c.hbm_bytes_per_s, c.ici_bytes_per_s) == (
            hbm * aot.GiB, peak, hbm_bw, ici), name  # fmt: skip
