"""Registries (`ac2_jax.registry`): every extension point from this file alone.

A toy family, a toy loss, a toy sampler and a toy request API are defined and
registered here, with nothing shared changed. Two toy families: one a whole model
of its own (`ToyLM`: the `CausalLM` protocol alone), one only a block and its
config on the library's transformer skeleton (`models.skeleton.Transformer`: the
embedding, layer loop / scan, head, LoRA rows, KV cache and decode are the
skeleton's). The families and the loss each train one RL step through `RLTrainer` (the loss picked by a config section's
`kind`, as a user's config would); the sampler serves one step of the RL recipe
(`sampler.kind`); the request API answers a request over real HTTP.
"""

import asyncio
import dataclasses
import json
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ac2_jax.config import ConfigError, from_config
from ac2_jax.losses import LMHead, attention_mask, token_logprobs
from ac2_jax.models import (
    FAMILIES,
    CausalLM,
    Decoder,
    DecoderConfig,
    ModelFamily,
    build_model,
    config_from_hf,
    register_family,
)
from ac2_jax.models.config import ModelConfig, resolve_config
from ac2_jax.models.layers import (
    Attention,
    RMSNorm,
    _param,
    attention_apply,
    rms_norm,
    rope_inv_freq,
)
from ac2_jax.models.skeleton import AttentionKind, Transformer
from ac2_jax.registry import Registry
from ac2_jax.training import OBJECTIVES, PolicyGradientLoss
from ac2_jax.training.core import Objective
from ac2_jax.training.rl import BatchConfig, RLConfig
from ac2_jax.training.rl.alarms import AlarmConfig, AlarmsConfig
from ac2_jax.training.rl.trainer import ReplayCollector, RLTrainer
from tests.support.recipe_helpers import ParityEnv
from tests.support.rl_traces import rl_trace

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


# --- a toy block family: one block (pre-norm attention + a tanh MLP) and its config on the
# skeleton; the skeleton brings the rest (stacked or per-layer, the cache, decode)


@dataclasses.dataclass(frozen=True)
class ToyBlockConfig(ModelConfig):
    family: str = "toy_block"
    gain: float = 1.0  # the family's own field: the MLP's output scale


class ToyBlock(nnx.Module):
    def __init__(self, c, rngs, stack=None):
        self.norm = RMSNorm(c.hidden_size, c.rms_eps, c.dtype, c.param_dtype, stack)
        self.self_attn = Attention(c, rngs, stack)
        init = nnx.initializers.normal(c.initializer_range)
        self.mix = _param(rngs, init, (c.hidden_size, c.hidden_size), c.param_dtype,
                          ("embed", "mlp"), stack)


class ToyBlockLM(Transformer):
    def build_layer(self, config, rngs, stack, count=None):
        return ToyBlock(config, rngs, count)

    def block(self, stack, w, x, rope, mask, run, cache=None, inputs=None):
        c = self.config
        h = rms_norm(w["norm"]["weight"], x, c.rms_eps, c.dtype)
        a, cache = attention_apply(c, w["self_attn"], h, rope, mask, run.backend, cache, run.lora)
        x = x + a
        return x + c.gain * jnp.tanh(x @ w["mix"].astype(c.dtype)), cache, None

    def attention_kinds(self):
        return (AttentionKind(self.config.sliding_window, rope_inv_freq(self.config)),)


class ToyBlockFamily(ModelFamily):
    hf_architecture = "ToyBlockForCausalLM"
    config_class = ToyBlockConfig
    lora_targets = ("q", "k", "v", "o")

    def build(self, config, rngs):
        return ToyBlockLM(config, rngs)

    def config_from_hf(self, hf, **kwargs):
        return ToyBlockConfig.tiny(hf["vocab_size"], gain=hf["gain"], **kwargs)

    def config_to_hf(self, config):
        return {"model_type": "toy_block", "vocab_size": config.vocab_size, "gain": config.gain}


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
    register_family("toy_block")(ToyBlockFamily)
    OBJECTIVES.register("reinforce")(Reinforce)
    yield
    FAMILIES.unregister("toy")
    FAMILIES.unregister("toy_block")
    OBJECTIVES.unregister("reinforce")


def _one_rl_step(model, loss, tmp_path):
    traces = [rl_trace("a", 0, 1.0, n_out=3), rl_trace("a", 1, 0.0, n_out=1)]
    config = RLConfig(steps=1, tasks_per_step=1, attempts_per_task=2, loss=loss,
                      batch=BatchConfig(seq_len=16, rows=2, layout="flat"))
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    # rl_trace's log-probs are made up (-0.5), not these models': no drift alarm here.
    alarms = AlarmsConfig(drift=AlarmConfig(threshold=0.1, action="off"))
    trainer = RLTrainer(model, ReplayCollector(traces), config, str(tmp_path), alarms=alarms)
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


def test_a_block_family_registered_here_decodes_and_trains_one_rl_step(toy_extensions, tmp_path):
    config = ToyBlockConfig.tiny(VOCAB, num_layers=2, gain=0.5, scan_layers=True, remat="none")
    model = build_model(config, nnx.Rngs(0))
    assert isinstance(model, ToyBlockLM) and isinstance(model, CausalLM)
    assert config_from_hf(config.to_hf_config(), scan_layers=True, remat="none") == config
    with pytest.raises(ValueError, match="registered family of this decoder \\(toy_block\\)"):
        resolve_config(ToyBlockConfig.tiny(VOCAB, family="qwen3"))  # built: pure data
    # The skeleton's KV cache: a prefill then a step give the packed forward's logits.
    @nnx.jit
    def both(model, tokens, positions):
        cache = model.init_cache(1, 8)
        prefill, cache = model.decode(tokens[:, :4], positions[:, :4], cache)
        step, _ = model.decode(tokens[:, 4:], positions[:, 4:], cache)
        full = model(tokens, positions, jnp.ones_like(tokens))
        return jnp.concatenate([prefill, step], 1), full

    cached, full = both(model, jnp.asarray([[3, 1, 4, 1, 5]]), jnp.arange(5)[None])
    np.testing.assert_allclose(cached, full, atol=1e-5)
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
    # A config is pure data: an unknown family constructs, and fails where it is built.
    unknown = DecoderConfig.tiny(family="qwen33")
    with pytest.raises(ValueError, match=r"registered family of this decoder \(llama, mistral, "
                                         r"qwen2, qwen3\), got 'qwen33'; did you mean 'qwen3'\?"):
        Decoder(unknown)
    with pytest.raises(ValueError, match=r"registered family of this decoder \(llama, mistral, qwen2, qwen3"):
        resolve_config(DecoderConfig.tiny(family="toy"))  # unknown here, not a DecoderConfig family
    with pytest.raises(TypeError, match="build_model: family 'qwen3' takes a DecoderConfig"):
        build_model(ToyConfig(vocab_size=4, family="qwen3"))


def test_distillation_losses_are_objectives():
    from ac2_jax.config_cli import to_dict
    from ac2_jax.losses import DIVERGENCES
    from ac2_jax.training.distill import DistillLoss, distill_objective

    assert {f"distill_{d}" for d in DIVERGENCES.names()} <= set(OBJECTIVES.names())
    rl = from_config(RLConfig, {"loss": {"kind": "distill_jsd", "beta": 0.3, "top_k": 6}})
    assert isinstance(rl.loss, DistillLoss) and isinstance(rl.loss, Objective)
    assert (rl.loss.kind, rl.loss.beta, rl.loss.top_k) == ("jsd", 0.3, 6)
    assert to_dict(rl)["loss"]["kind"] == "distill_jsd"  # the objective's name, read back
    assert from_config(RLConfig, {"loss": to_dict(rl)["loss"]}).loss == rl.loss
    # DistillLoss itself (as Python builds it) is the same objective: it writes as its
    # registered twin's kind (a config holding it used to fail to_dict: "not a registered
    # objective", so the RL recipe could not write its config.json), and reads back so.
    own = RLConfig(loss=DistillLoss(kind="jsd", beta=0.3, top_k=6))
    assert to_dict(own)["loss"] == to_dict(rl)["loss"]
    assert from_config(RLConfig, {"loss": to_dict(own)["loss"]}).loss == rl.loss
    # The same per-position values as DistillLoss(kind="jsd") (it is that class, kind fixed).
    rng = np.random.default_rng(0)
    batch = _distill_batch()
    s, t = (jnp.asarray(rng.normal(size=(*batch.tokens.shape, 12)), jnp.float32) for _ in "st")
    a, _ = rl.loss(s, batch, {"teacher_logits": t})
    b, _ = DistillLoss(kind="jsd", beta=0.3, top_k=6)(s, batch, {"teacher_logits": t})
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=0)
    with pytest.raises(ValueError, match="did you mean 'jsd'"):
        distill_objective("jsdd")
    with pytest.raises(ConfigError, match=r"loss\.kind: unknown objective 'distill_jsdd'.*did "
                                          r"you mean 'distill_jsd'"):
        from_config(RLConfig, {"loss": {"kind": "distill_jsdd"}})


def _distill_batch():
    """A paired batch of two examples (prompt, hinted prompt, response), student side."""
    from ac2_jax.training.distill import DistillExample, pack_pairs

    exs = [DistillExample([3, 4, 5], [3, 9, 4, 5], [6, 7, 2], "hint", "a"),
           DistillExample([5, 3], [5, 9, 3], [7, 7, 6, 2], "hint", "b")]
    return pack_pairs(exs, 16, min_rows=1).student


# --- toy samplers: uniform over the vocabulary (numpy, no model: the request API test's),
# and the policy recomputed per token (no KV cache: the registered sampler kind)


class UniformSampler:
    """Each output token drawn uniformly from the vocabulary: its behaviour log-prob is
    -log V whatever the temperature (the distribution the token was drawn from)."""

    def __init__(self, vocab_size, max_context, eos_token_ids, seed):
        self.vocab, self.context = vocab_size, max_context
        self.eos = set(eos_token_ids)
        self.rng = np.random.default_rng(seed)
        self.version, self.requests, self.loads = 0, 0, []

    @property
    def policy_version(self):
        return self.version

    @property
    def max_context(self):
        return self.context

    async def generate(self, prompt_ids, params, *, on_tokens=None):
        from ac2_jax.sampling import SampleResult, check_prompt

        check_prompt(prompt_ids, self.context, self.vocab)
        self.requests += 1
        ids = []
        for _ in range(min(params.max_tokens, self.context - len(prompt_ids))):
            ids.append(int(self.rng.integers(self.vocab)))
            if ids[-1] in self.eos or ids[-1] in params.stop_token_ids:
                break
        reason = "stop" if ids and (ids[-1] in self.eos or ids[-1] in params.stop_token_ids) \
            else "length"
        if on_tokens is not None:
            on_tokens(ids)
        return SampleResult(ids, [-math.log(self.vocab)] * len(ids), reason, self.version)

    def load_weights(self, step=None):
        self.loads.append(step)
        self.version = int(step)
        return self.version


class RecomputeSampler:
    """The policy itself, with no KV cache: each token recomputes the whole sequence (one
    compiled [1, max_context] forward, padding as segment 0) and is drawn from
    log_softmax(sampling_logits(logits, T, top_k, top_p)), which it reports (the contract).
    `load_weights` loads a published step into the model, as the JaxSampler does.

    Each request's key is the seed's, folded with the prompt and how many times that
    prompt was asked before, not drawn from one chain in arrival order: the 8
    concurrent rollouts arrive in an order the threads decide, and a chain made the
    rewards of a group depend on it, so about one run in 64 had every group of one
    reward (no advantage: the update skipped, no kl_to_sampler). Keyed so, a task's
    attempts get the same completions however they interleave."""

    def __init__(self, model, max_context, eos_token_ids, seed, publish_dir):
        from ac2_jax.losses import sampling_logits

        self.model, self.context, self.publish_dir = model, max_context, publish_dir
        self.eos = set(eos_token_ids)
        self.key = jax.random.key(seed)
        self.asked: dict[tuple[int, ...], int] = {}  # prompt -> requests of it so far
        self.version, self.requests, self.loads = 0, 0, []
        graphdef = nnx.graphdef(model)

        @jax.jit
        def next_token(state, tokens, n, key, temperature, top_k, top_p):
            positions = jnp.arange(tokens.shape[1])[None]
            logits = nnx.merge(graphdef, state)(tokens, positions, (positions < n).astype(
                jnp.int32))[0, n - 1]
            logp = jax.nn.log_softmax(sampling_logits(logits, temperature, top_k, top_p))
            tok = jnp.where(temperature > 0, jax.random.categorical(key, logp),
                            jnp.argmax(logp))
            return tok, logp[tok]

        self.next_token = next_token

    @property
    def policy_version(self):
        return self.version

    @property
    def max_context(self):
        return self.context

    async def generate(self, prompt_ids, params, *, on_tokens=None):
        from ac2_jax.sampling import SampleResult, check_prompt

        check_prompt(prompt_ids, self.context, self.model.config.vocab_size)
        if params.constraint is not None or params.top_logprobs or params.adapter:
            raise ValueError("RecomputeSampler: no constraint, top_logprobs or adapter")
        self.requests += 1
        prompt = tuple(int(t) for t in prompt_ids)
        nth = self.asked[prompt] = self.asked.get(prompt, -1) + 1
        request_key = jax.random.fold_in(
            jax.random.fold_in(self.key, zlib.crc32(np.asarray(prompt, np.int64).tobytes())), nth)
        seq, ids, lps, reason = list(prompt_ids), [], [], "length"
        state = nnx.state(self.model)
        while len(ids) < params.max_tokens and len(seq) < self.context:
            request_key, key = jax.random.split(request_key)
            tokens = jnp.asarray([seq + [0] * (self.context - len(seq))], jnp.int32)
            tok, lp = self.next_token(state, tokens, len(seq), key, params.temperature,
                                      params.top_k, params.top_p)
            ids.append(int(tok))
            lps.append(float(lp))
            seq.append(int(tok))
            if ids[-1] in self.eos or ids[-1] in params.stop_token_ids:
                reason = "stop"
                break
        if on_tokens is not None:
            on_tokens(ids)
        return SampleResult(ids, lps, reason, self.version)

    def load_weights(self, step=None):
        from ac2_jax.models.io.params_io import load_published

        self.version = load_published(self.model, self.publish_dir, step)
        self.loads.append(self.version)
        return self.version


@pytest.fixture
def toy_sampler():
    from ac2_jax.sampling.registry import SAMPLERS, SamplerKind

    built = []

    class RecomputeKind(SamplerKind):
        reads = ("options",)

        def check(self, config):
            if set(config.options or {}) - {"seed"}:
                raise ValueError(f"sampler.options: recompute reads only 'seed', got "
                                 f"{sorted(config.options)}")

        def build(self, config, setup):
            built.append(RecomputeSampler(setup.model, setup.max_context, setup.eos_token_ids,
                                          (config.options or {}).get("seed", 0),
                                          setup.publish_dir))
            return built[-1]

    SAMPLERS.register("recompute")(RecomputeKind)
    yield built
    SAMPLERS.unregister("recompute")


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """The tiny preset (test_recipe_rl's model: the suite's compilation cache has its step)."""
    from ac2_jax.recipes import load_model

    return load_model("tiny", str(tmp_path_factory.mktemp("tiny")))


def test_a_sampler_registered_here_serves_an_rl_recipe_step(toy_sampler, tiny_pair, tmp_path):
    from ac2_jax.config_cli import load_config
    from ac2_jax.recipes import RLRecipeConfig, rl
    from ac2_jax.trace import TraceStore

    cfg = load_config(RLRecipeConfig, None, [  # test_recipe_rl's run (shapes), on "recompute"
        "sampler.kind=recompute", "sampler.options={'seed': 3}", "sampler.max_context=128",
        "rl.steps=1", "rl.tasks_per_step=2", "rl.attempts_per_task=4", "rl.batch.rows=2",
        "rl.batch.seq_len=128", "rl.concurrency=8", "rollout.max_tokens=8", "rollout.max_steps=1",
        "log.progress=false", "log.report_files=false", "log.tensorboard=false",
        f"paths.workdir={tmp_path / 'run'}"])  # fmt: skip
    model, tokenizer = tiny_pair
    report = rl((model, tokenizer), ParityEnv(), cfg).report
    (sampler,) = toy_sampler
    assert report["steps"] == 1 and sampler.requests >= 8  # every attempt sampled here
    assert sampler.loads == [1] and sampler.policy_version == 1  # the step's publish
    traces = TraceStore(str(tmp_path / "run" / "traces" / "rollouts.jsonl")).read()
    assert {t.status for t in traces} <= {"finished", "agent_error"}  # no infra_error
    # The learner scored the sampled tokens as this sampler did: its log-probs are the
    # policy's (fp32, packed rows vs one padded row: a mean |delta| under 1e-3).
    assert report["final_pass_rate"] is not None
    metrics = [json.loads(x) for x in open(tmp_path / "run" / "metrics" / "metrics.jsonl")]
    assert metrics[0]["train/skipped_update"] == 0.0 and metrics[0]["train/grad_norm"] > 0
    assert abs(metrics[0]["train/kl_to_sampler"]) < 1e-3, metrics[0]["train/kl_to_sampler"]


def test_sampler_kinds_unknown_or_misconfigured_are_one_line(toy_sampler):
    from ac2_jax.recipes import RLRecipeConfig
    from ac2_jax.sampling.registry import SamplerConfig

    with pytest.raises(ConfigError, match=r"unknown sampler 'sglng'.*did you mean 'sglang'"):
        from_config(RLRecipeConfig, {"sampler": {"kind": "sglng"}})
    with pytest.raises(ConfigError, match=r"sampler\.url='http://h:1' has no effect with "
                                          r"sampler\.kind='jax' \(read by kind sglang\)"):
        from_config(RLRecipeConfig, {"sampler": {"url": "http://h:1"}})
    with pytest.raises(ValueError, match="kind='sglang' needs sampler.url"):
        SamplerConfig(kind="sglang")
    with pytest.raises(ValueError, match="lists a URL twice"):
        SamplerConfig(kind="fleet", backends=("http://a:1", "http://a:1"))
    with pytest.raises(ValueError, match=r"sampler\.warmup=False has no effect with "
                                         r"sampler\.kind='recompute'"):
        SamplerConfig(kind="recompute", warmup=False)
    with pytest.raises(ValueError, match="recompute reads only 'seed'"):
        SamplerConfig(kind="recompute", options={"sead": 1})
    assert SamplerConfig(kind="fleet", backends="http://a:1, http://b:2").backends == (
        "http://a:1", "http://b:2")


# --- a toy request API: POST /toy/complete {prompt, max_tokens} -> {text, ids}


@pytest.fixture
def toy_api():
    from fastapi import Request

    from ac2_jax.sampling import SamplingParams
    from ac2_jax.serving.apis import REQUEST_APIS, APIMount
    from ac2_jax.serving.core.errors import bad_request

    @REQUEST_APIS.register("toy")
    def mount_toy(m: APIMount) -> None:
        @m.app.post("/toy/complete")
        async def complete(request: Request):
            await m.authenticate(request)
            body = await m.read_json(request)
            if set(body) - {"prompt", "max_tokens"}:
                raise bad_request(f"unknown fields {sorted(set(body) - {'prompt', 'max_tokens'})}")
            ids = m.ctx.tokenizer.encode(body["prompt"])
            r = await m.ctx.sampler.generate(ids, SamplingParams(max_tokens=body["max_tokens"]))
            return {"ids": r.output_ids, "text": m.ctx.tokenizer.decode(r.output_ids),
                    "policy_version": r.policy_version}

    yield
    REQUEST_APIS.unregister("toy")


def test_a_request_api_registered_here_serves_over_http(toy_api, tiny_pair):
    import httpx

    from ac2_jax.serving import build_app, serve_in_thread
    from ac2_jax.serving.app import BUILTIN_APIS

    tok = tiny_pair[1]
    sampler = UniformSampler(tok.vocab_size, 64, (), seed=0)
    app = build_app(sampler, tok, admin_key="sk-toy")
    assert app.state.apis == (*BUILTIN_APIS, "toy")  # every registered API, built-ins first
    url, stop = serve_in_thread(app)
    try:
        headers = {"Authorization": "Bearer sk-toy"}
        r = httpx.post(url + "/toy/complete", json={"prompt": "hi", "max_tokens": 4},
                       headers=headers)
        assert r.status_code == 200 and len(r.json()["ids"]) == 4 and sampler.requests == 1, r.text
        assert r.json()["text"] == tok.decode(r.json()["ids"])
        r = httpx.post(url + "/toy/complete", json={"prompt": "hi"})  # no key: the app's 401
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        r = httpx.post(url + "/toy/complete", json={"prompt": "hi", "max_tokens": 1, "x": 1},
                       headers=headers)  # its own refusal, in the app's error shape
        assert r.status_code == 400 and "unknown fields ['x']" in r.json()["error"]["message"]
    finally:
        stop()
    # Mounted only where asked: an app of two APIs has neither the toy's route nor chat's.
    only = build_app(sampler, tok, admin_key="sk-toy", apis=("toy", "lifecycle"))
    paths = {getattr(r, "path", None) for r in only.routes}
    assert "/toy/complete" in paths and "/v1/rollouts" in paths
    assert "/v1/chat/completions" not in paths
    with pytest.raises(ValueError, match=r"unknown request API 'tyo'.*did you mean 'toy'"):
        build_app(sampler, tok, admin_key="sk-toy", apis=("tyo",))
    # A string is names, comma-separated (as --apis): not one name per character.
    from ac2_jax.serving.app import mounted_apis

    assert mounted_apis("toy, lifecycle") == mounted_apis("toy,lifecycle") == ("toy", "lifecycle")


def test_recipes_are_a_registry():
    from ac2_jax.recipes import RECIPES, RLRecipeConfig, rl
    from ac2_jax.train import UsageError, build

    assert RECIPES["rl"] == (RLRecipeConfig, rl) and "eval" in RECIPES
    with pytest.raises(UsageError, match=r"unknown recipe 'sf'.*did you mean 'sft'"):
        build(["--recipe=sf"])
