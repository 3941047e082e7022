"""Registries (`ac2_jax.registry`): a new model family and a new objective from this file alone.

The toy family and the toy loss below are defined and registered here, with
nothing shared changed, and each trains one RL step through `RLTrainer`; the
loss is picked by a config section's `kind`, as a user's config would.
"""

import asyncio
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ac2_jax.config import ConfigError, from_config
from ac2_jax.losses import LMHead, attention_mask, token_logprobs
from ac2_jax.models import (FAMILIES, CausalLM, DecoderConfig, ModelFamily, build_model,
                            config_from_hf, register_family)
from ac2_jax.registry import Registry
from ac2_jax.training import OBJECTIVES, PolicyGradientLoss
from ac2_jax.training.core import Objective
from ac2_jax.training.rl import BatchConfig, RLConfig
from ac2_jax.training.rl.trainer import ReplayCollector, RLTrainer
from rl_traces import rl_trace

VOCAB = 16


# --- a toy family: one causal averaging layer, its own config class


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    vocab_size: int
    hidden_size: int = 8
    family: str = "toy"


class ToyLM(nnx.Module):
    """Embeddings, a causal mean over the segment's tokens so far, a tanh MLP, a head."""

    def __init__(self, config: ToyConfig, rngs: nnx.Rngs):
        self.config = config
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (config.vocab_size,
                                                                 config.hidden_size)) * 0.1)
        self.mix = nnx.Linear(config.hidden_size, config.hidden_size, rngs=rngs)
        self.out = nnx.Param(jax.random.normal(rngs.params(), (config.hidden_size,
                                                               config.vocab_size)) * 0.1)

    def hidden_states(self, tokens, positions, segment_ids, subtree_end=None):
        mask = attention_mask(segment_ids, subtree_end).astype(jnp.float32)  # [R, L, L]
        x = jnp.take(self.embed[...], tokens, axis=0)
        mean = mask @ x / mask.sum(-1, keepdims=True)
        return jnp.tanh(self.mix(mean)) + x

    def head(self):
        return LMHead(self.out[...], "dv")

    def logits(self, hidden):
        return self.head().logits(hidden)

    def __call__(self, tokens, positions, segment_ids, subtree_end=None):
        return self.logits(self.hidden_states(tokens, positions, segment_ids, subtree_end))


class ToyFamily(ModelFamily):
    hf_architecture = "ToyForCausalLM"
    config_class = ToyConfig

    def build(self, config, rngs):
        return ToyLM(config, rngs)

    def config_from_hf(self, hf, **kwargs):
        return ToyConfig(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"])

    def config_to_hf(self, config):
        return {"architectures": [self.hf_architecture], "model_type": "toy",
                "vocab_size": config.vocab_size, "hidden_size": config.hidden_size}


# --- a toy objective: plain REINFORCE, l_t = -A log p(y_t), and one metric


@dataclasses.dataclass(frozen=True)
class Reinforce(Objective):
    mode: str = "task_mean"
    normalizer: float | None = None
    scale: float = 1.0

    def __call__(self, logits, batch, extras=None):
        logp = token_logprobs(logits, batch.targets)
        m = batch.loss_mask.astype(jnp.float32)
        return -self.scale * batch.features["advantages"] * logp, {"reinforce_logp": (m * logp).sum()}


@pytest.fixture
def toy_extensions():
    register_family("toy")(ToyFamily)
    OBJECTIVES.register("reinforce")(Reinforce)
    yield
    FAMILIES.unregister("toy")
    OBJECTIVES.unregister("reinforce")


def _one_rl_step(model, loss, tmp_path):
    traces = [rl_trace("a", 0, 1.0, n_out=3), rl_trace("a", 1, 0.0, n_out=1)]
    config = RLConfig(steps=1, tasks_per_step=1, attempts_per_task=2, loss=loss,
                      batch=BatchConfig(seq_len=16, rows=2, layout="flat"))
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    trainer = RLTrainer(model, ReplayCollector(traces), config, str(tmp_path))
    history = asyncio.run(trainer.run())
    after = jax.tree.map(np.asarray, nnx.state(trainer.model(), nnx.Param))
    trainer.close()
    changed = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before),
                                                        jax.tree.leaves(after))]
    return history[0], changed


def test_a_family_registered_here_trains_one_rl_step(toy_extensions, tmp_path):
    model = build_model(ToyConfig(vocab_size=VOCAB), nnx.Rngs(0))
    assert isinstance(model, ToyLM) and isinstance(model, CausalLM)
    assert config_from_hf(ToyFamily().config_to_hf(model.config)) == model.config
    # The chunked loss reads hidden states and the family's head, never dense logits.
    m, changed = _one_rl_step(model, PolicyGradientLoss(chunk_size=4), tmp_path)
    assert m["skipped_update"] == 0.0 and np.isfinite(m["loss"]) and all(changed), m


def test_an_objective_registered_here_trains_one_rl_step(toy_extensions, tmp_path):
    rl = from_config(RLConfig, {"steps": 1, "tasks_per_step": 1, "attempts_per_task": 2,
                                "loss": {"kind": "reinforce", "scale": 2.0}})
    assert rl.loss == Reinforce(scale=2.0)
    model = build_model(DecoderConfig.tiny(vocab_size=VOCAB, num_layers=1), nnx.Rngs(0))
    m, changed = _one_rl_step(model, rl.loss, tmp_path)
    assert m["skipped_update"] == 0.0 and all(changed), m
    # The step ran this loss: its metric (a token mean of log p) is there, and negative.
    assert m["reinforce_logp"] < 0.0, m


def test_a_config_names_an_unknown_or_wrong_kind():
    with pytest.raises(ConfigError, match=r"loss\.kind: unknown objective 'reinforc'"):
        from_config(RLConfig, {"loss": {"kind": "reinforc"}})
    with pytest.raises(ConfigError, match=r"loss.clip_eps: unknown key for SFTLoss"):
        from_config(RLConfig, {"loss": {"kind": "sft", "clip_eps": 0.2}})  # not an SFTLoss field
    assert from_config(RLConfig, {"loss": {"clip_eps": 0.3}}).loss == PolicyGradientLoss(
        clip_eps=0.3)  # no kind: the default, "ppo"


def test_registry_names_taken_and_unknown():
    reg = Registry("widget")
    reg.register("a")(int)
    assert reg.get("a") is int and "a" in reg and reg.names() == ("a",)
    assert reg.name_of(3) == "a"
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(float)
    reg.register("a", replace=True)(float)
    assert reg.get("a") is float
    with pytest.raises(ValueError, match=r"unknown widget 'b'.*registered are a"):
        reg.get("b")
    with pytest.raises(ValueError, match="non-empty"):
        reg.register("")


def test_builtin_families_load_on_first_lookup():
    assert {"qwen3", "llama"} <= set(FAMILIES.names())
    for family in ("qwen3", "llama"):
        config = DecoderConfig.tiny(family=family, qk_norm=family == "qwen3")
        hf = config.to_hf_config()
        assert hf["model_type"] == family and config_from_hf(hf) == config
    with pytest.raises(ValueError, match=r"registered family of this decoder \(llama, mistral, qwen2, qwen3"):
        DecoderConfig.tiny(family="toy")  # unknown here, and not a DecoderConfig family
    with pytest.raises(TypeError, match="build_model: family 'qwen3' takes a DecoderConfig"):
        build_model(ToyConfig(vocab_size=4, family="qwen3"))
