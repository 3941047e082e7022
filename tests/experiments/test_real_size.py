"""Real-size presets (experiments/real_size/qwen3.py) and their random checkpoints
(experiments/real_size/checkpoint.py): the shapes are Qwen3-0.6B's and 1.7B's (parameter
counts, without building them), and a tiny checkpoint written the same way loads
with the preset's runtime choices and matches transformers (fp32, 1e-4)."""

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ac2_jax.models import Decoder, DecoderConfig  # noqa: E402
from ac2_jax.models.io.hf_io import load_hf_config  # noqa: E402
from experiments.real_size.checkpoint import (  # noqa: E402
    load_preset,
    preset_runtime,
    qwen3_config,
    write_random_checkpoint,
)
from experiments.real_size.qwen3 import get_config  # noqa: E402


def param_count(cfg):
    """(total, without the embedding) of the preset's shape, from an abstract Decoder."""
    config = DecoderConfig.from_hf_config(qwen3_config(cfg.shape).to_dict(), scan_layers=True)
    state = nnx.state(nnx.eval_shape(lambda: Decoder(config)), nnx.Param)
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    return total, total - config.vocab_size * config.hidden_size, config


@pytest.mark.parametrize("variant,total,body", [(None, 596_049_920, 440_467_456),
                                                ("1.7b_gpu", 1_720_574_976, 1_409_410_048)])
def test_presets_have_the_qwen3_shapes(variant, total, body):
    cfg = get_config(variant)
    got_total, got_body, config = param_count(cfg)
    assert (got_total, got_body) == (total, body)  # Qwen3: 0.6B / 0.44B and 1.7B / 1.4B
    assert (config.vocab_size, config.num_heads, config.num_kv_heads, config.head_dim,
            config.num_layers, config.rope_theta, config.tie_embeddings) == (
        151_936, 16, 8, 128, 28, 1e6, True)
    assert cfg.model.scan_layers and cfg.model.remat in ("full", "save_dots")
    assert "train" not in get_config("1.7b")  # 27.5 GB of train state: no CPU train plan


def test_tiny_random_checkpoint_loads_with_the_preset_and_matches_transformers(tmp_path):
    cfg = get_config("tiny")
    path = write_random_checkpoint(cfg.shape, str(tmp_path / "ckpt"), seed=1)
    model, config = load_preset(cfg, path)
    assert config.scan_layers and config.remat == "full" and config.num_layers == 3
    assert model.layers.mlp.up_proj[...].shape == (3, 32, 64)
    # The same config from config.json alone (no weights read): for abstract compiles.
    assert load_hf_config(path, **preset_runtime(cfg)) == config
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = np.random.default_rng(0).integers(0, 512, 30)
    with torch.no_grad():
        ref = hf(torch.tensor(tokens[None])).logits[0].numpy()
    t = jax.numpy.asarray(tokens[None], jax.numpy.int32)
    ours = nnx.jit(lambda m: m(t, jax.numpy.arange(30)[None], jax.numpy.ones_like(t)))(model)
    assert np.abs(np.asarray(ours[0]) - ref).max() <= 1e-4
    cfg.model.remat = "sometimes"
    with pytest.raises(ValueError, match="remat must be one of"):
        load_preset(cfg, path)
