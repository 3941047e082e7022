"""HF checkpoint I/O: logits parity with transformers (torch CPU, fp32), both ways,
also through a model with stacked (scanned) layers.

Tolerance: max |logit difference| <= 1e-4 in fp32. Weights use std 0.2 and
perturbed norm weights so that every tensor matters to the logits.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ac2_jax.models import Decoder, DecoderConfig  # noqa: E402
from ac2_jax.models.io.hf_io import (  # noqa: E402
    INDEX_FILE,
    SINGLE_FILE,
    hf_state_dict,
    load_hf_checkpoint,
    save_hf_checkpoint,
)

TOL = 1e-4
VOCAB = 97
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8}

CASES = {  # family, tied, kv_heads, llama3 rope
    "qwen3-gqa-tied": ("qwen3", True, 2, False),
    "qwen3-mha-untied": ("qwen3", False, 4, False),
    "llama-gqa-untied": ("llama", False, 1, False),
    "llama-gqa-tied-rope3": ("llama", True, 2, True),
}


def hf_model(family, tied, kv_heads, llama3, seed=0):
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16,
              tie_word_embeddings=tied, initializer_range=0.2, rms_norm_eps=1e-6,
              max_position_embeddings=256)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if llama3:
        rope = {**LLAMA3_ROPE, "rope_theta": 500000.0}
    cls = transformers.Qwen3Config if family == "qwen3" else transformers.LlamaConfig
    cfg = cls(rope_parameters=rope, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


@nnx.jit
def forward(model, tokens, positions, segment_ids):
    return model(tokens, positions, segment_ids)


def our_logits(model, tokens):
    t = jnp.asarray([tokens], jnp.int32)
    pos = jnp.arange(len(tokens))[None]
    return np.asarray(forward(model, t, pos, jnp.ones_like(t)))[0]


def random_model(config, seed, std=0.2):
    """A Decoder with weights of std 0.2 and norms around 1, so every tensor matters.

    Built from numpy on an abstract model (skips compiling jax.random per shape).
    """
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(config)))
    leaves = []
    for key, var in nnx.to_flat_state(state):
        base = 1.0 if len(var.shape) == 1 else 0.0
        leaves.append((key, var.replace(
            jnp.asarray(base + std * rng.standard_normal(var.shape), jnp.float32))))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


@pytest.mark.parametrize("case", list(CASES))
def test_hf_to_ours_logits(case, tmp_path):
    family, tied, kv, llama3 = CASES[case]
    hf = hf_model(family, tied, kv, llama3)
    hf.save_pretrained(tmp_path)
    model, config = load_hf_checkpoint(str(tmp_path))
    assert (config.family, config.tie_embeddings, config.num_kv_heads) == (family, tied, kv)
    assert config.qk_norm == (family == "qwen3")
    assert (config.rope_scaling is not None) == llama3
    rng = np.random.default_rng(1)
    a = rng.integers(0, VOCAB, 23).tolist()
    b = rng.integers(0, VOCAB, 14).tolist()
    ref_a, ref_b = hf_logits(hf, a), hf_logits(hf, b)
    assert np.abs(our_logits(model, a) - ref_a).max() <= TOL
    # One packed row, two segments, trailing padding vs HF on each segment alone.
    L = len(a) + len(b) + 5
    tokens = np.zeros((1, L), np.int32)
    tokens[0, :len(a) + len(b)] = a + b
    pos = np.zeros((1, L), np.int32)
    pos[0, :len(a)] = np.arange(len(a))
    pos[0, len(a):len(a) + len(b)] = np.arange(len(b))
    seg = np.zeros((1, L), np.int32)
    seg[0, :len(a)], seg[0, len(a):len(a) + len(b)] = 1, 2
    packed = np.asarray(forward(model, jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(seg)))[0]
    assert np.abs(packed[:len(a)] - ref_a).max() <= TOL
    assert np.abs(packed[len(a):len(a) + len(b)] - ref_b).max() <= TOL
    # The check can fail: the same row without segment separation differs.
    unsep = np.asarray(forward(model, jnp.asarray(tokens), jnp.asarray(pos),
                               jnp.asarray(seg > 0, jnp.int32)))[0]
    assert np.abs(unsep[len(a):len(a) + len(b)] - ref_b).max() > 1e-2


@pytest.mark.parametrize("case", list(CASES))
def test_ours_to_hf_logits(case, tmp_path):
    family, tied, kv, llama3 = CASES[case]
    config = DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=kv, head_dim=16, qk_norm=family == "qwen3",
                           rope_theta=500000.0 if llama3 else 10000.0, tie_embeddings=tied,
                           family=family, max_position_embeddings=256,
                           rope_scaling=dict(LLAMA3_ROPE) if llama3 else None)
    model = random_model(config, seed=4)
    save_hf_checkpoint(model, str(tmp_path))
    names = set(hf_state_dict(model))
    assert ("lm_head.weight" in names) == (not tied)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    assert type(hf).__name__ == ("Qwen3ForCausalLM" if family == "qwen3" else "LlamaForCausalLM")
    tokens = np.random.default_rng(5).integers(0, VOCAB, 30).tolist()
    assert np.abs(our_logits(model, tokens) - hf_logits(hf, tokens)).max() <= TOL


def test_scanned_model_reads_and_writes_the_same_hf_tensors(tmp_path):
    hf = hf_model("qwen3", True, 2, False, seed=3)
    hf.save_pretrained(tmp_path / "hf")
    model, config = load_hf_checkpoint(str(tmp_path / "hf"), scan_layers=True, remat="full")
    assert config.scan_layers and config.remat == "full"
    assert model.layers.self_attn.q_proj[...].shape == (2, 32, 64)  # stacked [layers, in, out]
    tokens = np.random.default_rng(6).integers(0, VOCAB, 25).tolist()
    ref = hf_logits(hf, tokens)
    assert np.abs(our_logits(model, tokens) - ref).max() <= TOL
    per_layer, _ = load_hf_checkpoint(str(tmp_path / "hf"))
    ours, theirs = hf_state_dict(model), hf_state_dict(per_layer)
    assert sorted(ours) == sorted(theirs) and "model.layers.1.self_attn.q_proj.weight" in ours
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name])
    save_hf_checkpoint(model, str(tmp_path / "ours"))
    back = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "ours"), dtype=torch.float32, attn_implementation="eager").eval()
    assert np.abs(hf_logits(back, tokens) - ref).max() <= TOL
    with pytest.raises(ValueError, match="come from config.json"):
        load_hf_checkpoint(str(tmp_path / "hf"), num_layers=3)


def test_sharded_round_trip(tmp_path):
    config = DecoderConfig.tiny(VOCAB, tie_embeddings=False)
    model = random_model(config, seed=8)
    save_hf_checkpoint(model, str(tmp_path), max_shard_bytes=10_000)
    files = sorted(os.listdir(tmp_path))
    with open(tmp_path / INDEX_FILE) as f:
        index = json.load(f)
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and shards <= set(files) and SINGLE_FILE not in files
    back, back_config = load_hf_checkpoint(str(tmp_path))
    assert back_config == model.config != config  # the model's, resolved; config kept "auto"
    ours = nnx.to_flat_state(nnx.state(model, nnx.Param))
    theirs = dict(nnx.to_flat_state(nnx.state(back, nnx.Param)))
    for key, var in ours:
        np.testing.assert_array_equal(np.asarray(var[...]), np.asarray(theirs[key][...]))
    # transformers reads the sharded layout too.
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                           attn_implementation="eager")
    tokens = list(range(1, 20))
    assert np.abs(our_logits(model, tokens) - hf_logits(hf.eval(), tokens)).max() <= TOL
    # Saving again unsharded removes the old shards.
    save_hf_checkpoint(model, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["config.json", SINGLE_FILE]


def test_hf_sharded_save_is_read(tmp_path):
    hf = hf_model("qwen3", False, 2, False, seed=9)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / INDEX_FILE).exists()
    model, _ = load_hf_checkpoint(str(tmp_path))
    tokens = list(range(3, 40))
    assert np.abs(our_logits(model, tokens) - hf_logits(hf, tokens)).max() <= TOL


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model_type"):
        load_hf_checkpoint(str(tmp_path))
    save_hf_checkpoint(random_model(DecoderConfig.tiny(VOCAB), seed=0), str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape"):
        load_hf_checkpoint(str(tmp_path))


def test_load_holds_about_one_leaf_beside_the_model(tmp_path):
    """The load fills each param in place in one host array of its final dtype: numpy's
    high-water mark during `load_hf_checkpoint` stays under 1.5x the largest stacked
    leaf. (The old load kept every layer's tensor in a list, then `np.stack`ed them:
    2x the leaf in numpy alone, docs/notes/2026-12-05-lora-memory-time-publish-real-size.md.) Also
    checks a bf16 load casts on the way, to the values a jnp cast gives."""
    import tracemalloc

    config = DecoderConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=8192,
                           num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                           scan_layers=True)  # a layer is 1/4 of a stacked leaf
    model = random_model(config, seed=1)
    save_hf_checkpoint(model, str(tmp_path))
    leaf = max(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    tracemalloc.start()
    try:
        loaded, _ = load_hf_checkpoint(str(tmp_path), scan_layers=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1.5 * leaf, (peak, leaf)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(loaded)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    half, _ = load_hf_checkpoint(str(tmp_path), param_dtype=jnp.bfloat16, scan_layers=True)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(half)),
                    strict=True):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))
