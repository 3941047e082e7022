"""The memory plan (`models.memory_plan`): the default train step of a large-shaped model
picks the lean choices (scanned layers, remat "full", block-sparse attention at long
rows, chunked log-probs) and logs them; a small model keeps the fast ones; an explicit
value always wins.

The large model is the Qwen3-0.6B shape (transformers' `Qwen3Config` with the numbers of
experiments/real_size/qwen3.py) cut to 2 layers: 187M params, the real 151,936 vocabulary.
Its step is only traced and lowered from an abstract state (no weights, no compile), so
the test holds no parameter memory."""

import json
import logging

import jax
import numpy as np
import pytest
from flax import nnx

from ac2_jax.models import Decoder, DecoderConfig, Gemma3Config, resolve_config
from ac2_jax.models import memory_plan as mp
from ac2_jax.models.io.hf_io import load_hf_config
from ac2_jax.segments import pack_segments
from ac2_jax.training import (
    OptimizerConfig,
    PolicyGradientLoss,
    create_train_state,
    make_train_step,
)
from ac2_jax.training.core import abstract_train_state
from ac2_jax.training.rl import rl_segment

transformers = pytest.importorskip("transformers")

LOGGER = "ac2_jax.models.memory_plan"
OPT = OptimizerConfig(learning_rate=1e-6, weight_decay=0.1, clip_norm=1.0)
QWEN3_0_6B = dict(
    vocab_size=151_936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40_960,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def qwen3_cut(tmp_path_factory):
    """An HF directory holding the config.json of the Qwen3-0.6B shape cut to 2 layers."""
    path = tmp_path_factory.mktemp("qwen3_cut")
    hf = transformers.Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": 2}).to_dict()
    (path / "config.json").write_text(json.dumps(hf))
    return str(path)


def rl_batch(n: int, vocab: int):
    ids = np.random.default_rng(0).integers(0, vocab, n)
    seg = rl_segment(
        ids,
        np.r_[np.zeros(n // 2), np.ones(n - n // 2)],
        np.full(n, -1.0),
        task="t0",
        advantage=1.0,
    )
    return pack_segments([seg], n)


def step_plan_lines(caplog):
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and r.getMessage().startswith("train step memory plan")
    ]


def lowered_text(config, loss, n):
    """(the step's lowered StableHLO text, the plan lines it logged): traced, not compiled."""
    graphdef, abstract = abstract_train_state(lambda: Decoder(config, rngs=nnx.Rngs(0)), OPT)
    step = make_train_step(graphdef, loss, OPT)
    return step.lower(abstract, rl_batch(n, config.vocab_size)).as_text()


def test_default_train_step_of_a_large_shaped_model_picks_the_lean_choices_and_logs_them(
    qwen3_cut, caplog
):
    caplog.set_level(logging.INFO, logger=LOGGER)
    read = load_hf_config(qwen3_cut)  # runtime fields left to their defaults: pure data
    assert (read.scan_layers, read.remat) == ("auto", "auto") and not caplog.records
    config = resolve_config(read)  # the plan decides, where the model is built
    built = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert config.scan_layers is True and config.remat == "full"
    assert any(
        "scan_layers=True" in m and "remat=full" in m and "187M params >= 100M" in m for m in built
    ), built

    hlo = lowered_text(config, PolicyGradientLoss(mode="task_mean"), 1024)
    (line,) = step_plan_lines(caplog)
    assert "1 x 1,024 tokens" in line
    assert "scan_layers=True, remat=full (as auto: 187M params >= 100M)" in line
    assert "attention=blocksparse (auto on cpu: rows of 1,024 tokens, block 128)" in line
    assert "log-probs chunked 256 (auto: dense logits 622 MB > 168 MB)" in line
    # The choices reached the step: logits come 256 positions at a time, never the row's.
    assert "256x151936xf32" in hlo and "1024x151936xf32" not in hlo

    p = mp.plan(config, tokens=1024, device_memory_bytes=24 * 2**30)
    assert (p.lean, p.scan_layers, p.remat, p.logprob_chunk) == (True, True, "full", 256)
    assert p.attention_backend == "blocksparse"
    assert mp.plan(config, tokens=256).attention_backend == "dense"  # short rows: dense


def test_a_small_model_keeps_the_fast_choices(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    model = Decoder(DecoderConfig.tiny(vocab_size=64), rngs=nnx.Rngs(0))
    config = model.config  # the model's config is resolved
    assert config.scan_layers is False and config.remat == "none"
    graphdef, state = create_train_state(model, OPT)
    step = make_train_step(graphdef, PolicyGradientLoss(mode="task_mean"), OPT)
    batch = rl_batch(32, config.vocab_size)
    state, metrics = step(state, batch)
    state, metrics = step(state, batch)  # same shape: traced once, logged once
    assert np.isfinite(float(metrics["loss"]))
    (line,) = step_plan_lines(caplog)
    assert "scan_layers=False, remat=none (as auto:" in line and "< 100M" in line
    assert "attention=dense" in line and "log-probs dense (auto: dense logits" in line


def test_explicit_values_win(qwen3_cut, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    config = load_hf_config(
        qwen3_cut, scan_layers=False, remat="save_dots", attention_backend="dense"
    )
    assert (config.scan_layers, config.remat, config.attention_backend) == (
        False,
        "save_dots",
        "dense",
    )
    assert not [r for r in caplog.records if r.name == LOGGER]  # nothing left to plan
    hlo = lowered_text(config, PolicyGradientLoss(mode="task_mean", chunk_size=None), 1024)
    (line,) = step_plan_lines(caplog)
    assert "scan_layers=False (set; auto would pick True)" in line
    assert "remat=save_dots (set; auto would pick full)" in line
    assert "attention=dense (set)" in line
    assert "log-probs dense (set by the loss; auto would pick chunk 256)" in line
    assert "1024x151936xf32" in hlo
    # One field explicit, the other auto; a small model may be made lean by hand.
    assert resolve_config(load_hf_config(qwen3_cut, remat="none")).scan_layers is True
    tiny = DecoderConfig.tiny(scan_layers=True, remat=True)
    assert (tiny.scan_layers, tiny.remat) == (True, "full")
    with pytest.raises(ValueError, match="scan_layers must be a bool or 'auto'"):
        DecoderConfig.tiny(scan_layers="yes")


def test_the_device_memory_makes_a_smaller_model_lean(monkeypatch):
    """Below the size threshold the config is resolved lean when the fast plan's estimate at
    4,096 tokens exceeds half the device's memory."""
    shape = dict(
        vocab_size=32_000,
        hidden_size=512,
        intermediate_size=1536,
        num_layers=8,
        num_heads=8,
        num_kv_heads=4,
        head_dim=64,
        max_position_embeddings=8192,
    )
    plans = {}
    for gib in (64, 2):
        monkeypatch.setattr(mp, "available_memory_bytes", lambda gib=gib: gib * 2**30)
        config = resolve_config(DecoderConfig.tiny(**shape))
        plans[gib] = (config.scan_layers, config.remat), mp.plan(config)
    assert mp.param_count(config) < mp.LEAN_PARAMS
    (roomy, roomy_plan), (tight, tight_plan) = plans[64], plans[2]
    assert roomy == (False, "none") and not roomy_plan.lean
    assert tight == (True, "full") and tight_plan.lean
    assert "fast plan" in tight_plan.reasons["remat"]
    assert "> 50% of 2.1 GB" in tight_plan.reasons["remat"]
    assert tight_plan.estimate_bytes < roomy_plan.estimate_bytes


def test_param_count_matches_the_model_and_chunks_follow_the_logits_bytes():
    config = DecoderConfig.tiny(vocab_size=64, tie_embeddings=False)
    params = nnx.state(Decoder(config, rngs=nnx.Rngs(0)), nnx.Param)
    assert mp.param_count(config) == sum(x.size for x in jax.tree.leaves(params))
    assert mp.logprob_chunk_for(1, 1024, 151_936) == 256
    assert mp.logprob_chunk_for(1, 4096, 151_936) == 256
    assert mp.logprob_chunk_for(4, 4096, 151_936) == 64
    assert mp.logprob_chunk_for(16, 64, 256) is None  # small logits: dense
    # under a mesh the bound is a device's: 8 rows over data x fsdp = 1 x 8 are one row a
    # device (issue 69: all 8 rows counted gave 32 positions, a 256-trip loop at 8,192)
    assert mp.logprob_chunk_for(8, 8192, 151_936) == 32
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(1, 8), ("data", "fsdp"))
    with jax.set_mesh(mesh):
        assert mp.logprob_chunk_for(8, 8192, 151_936) == 256
        assert mp.logprob_chunk_for(4, 8192, 151_936) == 256  # ceil(4 / 8) = 1 row
    assert mp.available_memory_bytes() > 0 and mp.host_memory_bytes() > 0


def test_a_config_is_pure_data_resolved_once_where_the_model_is_built(monkeypatch):
    """Building a config reads no family registry, device or JAX backend (each refuses
    here); "auto" stays in the config. The model resolves it (once: its config is the
    resolved one, so layouts, LoRA and rebuilds plan nothing more), and models of a
    config and of its resolved copy share one graph definition (one jit cache entry)."""
    from jax._src import xla_bridge

    from ac2_jax.models.family import FAMILIES
    from ac2_jax.models.moe import MoEDecoderConfig
    from ac2_jax.models.stacking import with_layout

    def refuse(*args, **kwargs):
        raise AssertionError("building a config touched the registry, a device or a backend")

    with monkeypatch.context() as m:
        for owner, name in [(mp, "plan"), (mp, "available_memory_bytes"), (jax, "devices"),
                            (xla_bridge, "backends"), (xla_bridge, "backends_are_initialized"),
                            *((type(FAMILIES), n) for n in ("_load", "get", "names"))]:  # fmt: skip
            m.setattr(owner, name, refuse)
        configs = [
            DecoderConfig.tiny(64),
            DecoderConfig.tiny(64, family="qwen33", lora=dict(rank=2)).replace(num_layers=3),
            MoEDecoderConfig.tiny(64, lora=dict(targets=("q", "gate"))),
            Gemma3Config.tiny(64),
        ]
    assert all((c.scan_layers, c.remat, c.is_resolved) == ("auto", "auto", False) for c in configs)

    calls, plan_runtime = [], mp.resolve_runtime

    def counted(config):
        calls.append(config)
        return plan_runtime(config)

    monkeypatch.setattr(mp, "resolve_runtime", counted)
    auto = configs[0]
    model = nnx.eval_shape(lambda: Decoder(auto))
    resolved = model.config
    assert (resolved.scan_layers, resolved.remat, resolved.is_resolved) == (False, "none", True)
    assert resolved != auto and resolved == resolve_config(auto) and len(calls) == 2
    assert resolve_config(resolved) is resolved  # nothing left to plan: the same config
    again = nnx.eval_shape(lambda: Decoder(resolved))
    stacked = with_layout(Decoder(resolved), True)
    lora = nnx.eval_shape(lambda: Decoder(resolved.replace(lora=dict(rank=2))))
    assert len(calls) == 2 and stacked.config.remat == "none" and lora.config.is_resolved
    assert nnx.graphdef(model) == nnx.graphdef(again)  # one jit cache entry for both
    assert hash(nnx.graphdef(model)) == hash(nnx.graphdef(again))
