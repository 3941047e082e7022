"""Qwen3-MoE and Qwen2-MoE (models/qwen3_moe.py, moe_decoder.py, moe.py) against transformers.

Qwen3MoeForCausalLM / Qwen2MoeForCausalLM at tiny shapes (8 experts, top 2;
a dense layer by mlp_only_layers or decoder_sparse_step; norm_topk_prob both
ways; Qwen2-MoE's shared expert and q/k/v biases), random fp32 weights of
std 0.1 with perturbed norms and biases. Log-probs within 1e-5 for packed
rows, prefill + decode and stacked layers; the HF round trip bit-identical;
the load-balancing loss equal to transformers' `aux_loss`. Then what HF has
no counterpart of: capacity drops are counted, and routing replay.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ac2_jax.models.config import resolve_config  # noqa: E402
from ac2_jax.models.family import config_from_hf  # noqa: E402
from ac2_jax.models.io.hf_io import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from ac2_jax.models.moe import MoEDecoderConfig, capacity_of, experts_apply  # noqa: E402

TOL = 1e-5
VOCAB = 89
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
             rms_norm_eps=1e-6, max_position_embeddings=256, num_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=16)
CASES = {  # name: (config class, extra kwargs)
    "qwen3_moe-norm": (transformers.Qwen3MoeConfig, dict(
        head_dim=8, mlp_only_layers=[0], norm_topk_prob=True)),
    "qwen3_moe-step2-tied": (transformers.Qwen3MoeConfig, dict(
        head_dim=8, decoder_sparse_step=2, norm_topk_prob=False, tie_word_embeddings=True)),
    "qwen2_moe-shared": (transformers.Qwen2MoeConfig, dict(
        mlp_only_layers=[2], norm_topk_prob=False, shared_expert_intermediate_size=24)),
}


def hf_model(case, seed=0):
    cls, extra = CASES[case]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        cls(**SHAPE, **extra), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return model


def hf_logprobs(model, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits, -1).numpy()


def logprobs(logits):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits), -1))


@nnx.jit
def forward(model, tokens, positions, segment_ids):
    return model(tokens, positions, segment_ids)


@nnx.jit
def with_router(model, tokens, positions, segment_ids, routing=None):
    h, stats = model.forward_with_router(tokens, positions, segment_ids, routing=routing)
    return model.logits(h), stats


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    hf = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    hf.save_pretrained(path)
    model, config = load_hf_checkpoint(str(path))
    return request.param, hf, path, model, config


def packed_two(a, b, pad=4):
    L = len(a) + len(b) + pad
    tokens, pos, seg = (np.zeros((1, L), np.int32) for _ in range(3))
    tokens[0, :len(a) + len(b)] = a + b
    pos[0, :len(a)], pos[0, len(a):len(a) + len(b)] = np.arange(len(a)), np.arange(len(b))
    seg[0, :len(a)], seg[0, len(a):len(a) + len(b)] = 1, 2
    return tuple(map(jnp.asarray, (tokens, pos, seg)))


def test_config_read_as_the_family(pair):
    case, hf, _, model, config = pair
    assert isinstance(config, MoEDecoderConfig) and config.family == case.split("-")[0]
    hc = hf.config
    assert (config.num_experts, config.num_experts_per_tok) == (8, 2)
    assert config.norm_topk_prob == hc.norm_topk_prob
    moe = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert list(config.moe_layers) == moe and len(moe) < config.num_layers
    assert config.qk_norm == case.startswith("qwen3") and config.attention_bias != config.qk_norm
    assert bool(config.shared_expert_intermediate_size) == case.startswith("qwen2")


def test_packed_rows_logprobs_and_aux_loss_equal_transformers(pair):
    """Two segments in one row plus padding: each segment's log-probs equal transformers'
    on it alone, and the load-balancing loss over the real tokens equals transformers'
    aux_loss (output_router_logits) of the two as a right-padded batch."""
    _, hf, _, model, _ = pair
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, VOCAB, 19).tolist(), rng.integers(0, VOCAB, 11).tolist()
    logits, stats = with_router(model, *packed_two(a, b))
    out = logprobs(logits)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([a, b + [0] * 8]), output_router_logits=True,
                 attention_mask=torch.tensor([[1] * 19, [1] * 11 + [0] * 8]))
    ref_lp = torch.log_softmax(ref.logits, -1).numpy()
    assert np.abs(out[:19] - ref_lp[0]).max() <= TOL
    assert np.abs(out[19:30] - ref_lp[1, :11]).max() <= TOL
    assert abs(float(stats.load_balancing_loss()) - float(ref.aux_loss)) <= TOL
    assert float(stats.tokens) == 30 and float(stats.counts.sum()) == 2 * 30 * len(stats.counts)


def test_decode_logprobs_equal_transformers(pair):
    """Single-token steps through `decode`: every step's log-probs equal transformers'
    forward of the whole sequence, and the routing decode records is the packed
    forward's."""
    _, hf, _, model, _ = pair
    tokens = np.random.default_rng(2).integers(0, VOCAB, 15).tolist()
    step = nnx.jit(lambda m, t, p, c: m.decode(t, p, c, return_routing=True))
    cache = model.init_cache(1, 16)
    got, ids = [], []
    for p in range(len(tokens)):
        logits, cache, routed = step(model, jnp.asarray([[tokens[p]]]), jnp.asarray([[p]]), cache)
        got.append(logprobs(logits)[0])
        ids.append(np.asarray(routed)[0])
    assert np.abs(np.concatenate(got) - hf_logprobs(hf, tokens)).max() <= TOL
    a, b = tokens[:9], tokens[9:]
    _, stats = with_router(model, *packed_two(a, b, pad=34 - len(tokens)))
    assert (np.concatenate(ids)[:9] == np.asarray(stats.experts)[0, :9]).all()


def test_scanned_layers_equal_transformers(pair):
    """Stacked layers (MoE and dense stacks, run by runs of one kind): the packed
    forward and prefill in two chunks through the stacked cache equal transformers."""
    _, hf, path, _, config = pair
    model, _ = load_hf_checkpoint(str(path), scan_layers=True)
    assert model.layers.mlp.gate[...].shape == (len(config.moe_layers), 32, 8)
    tokens = np.random.default_rng(3).integers(0, VOCAB, 18).tolist()
    ref = hf_logprobs(hf, tokens)
    out = logprobs(with_router(model, *packed_two(tokens[:9], tokens[9:], pad=16))[0])[0]
    assert np.abs(out[:9] - ref[:9]).max() <= TOL
    step = nnx.jit(lambda m, t, p, c: m.decode(t, p, c))
    cache = model.init_cache(1, 24)
    t = jnp.asarray([tokens])
    first, cache = step(model, t[:, :9], jnp.arange(9)[None], cache)
    second, _ = step(model, t[:, 9:], jnp.arange(9, 18)[None], cache)
    got = logprobs(jnp.concatenate([first, second], axis=1))[0]
    assert np.abs(got - ref).max() <= TOL


def test_hf_round_trip_is_bit_exact(pair, tmp_path):
    """HF save -> our load -> our save (per-layer and stacked): the same tensors bit for
    bit (per-expert names, as transformers writes them) and the same config."""
    _, hf, path, model, config = pair
    theirs = load_file(path / "model.safetensors")
    if hf.config.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in theirs
    for scan in (False, True):
        m = model if not scan else load_hf_checkpoint(str(path), scan_layers=True)[0]
        save_hf_checkpoint(m, str(tmp_path / str(scan)))
        ours = load_file(tmp_path / str(scan) / "model.safetensors")
        assert sorted(theirs) == sorted(ours)
        for name in theirs:
            assert theirs[name].dtype == ours[name].dtype
            assert theirs[name].tobytes() == ours[name].tobytes(), name
    _, back = load_hf_checkpoint(str(tmp_path / "False"))
    assert back == config
    skip = {"transformers_version", "architectures", "_name_or_path", "dtype"}
    a = {k: v for k, v in hf.config.to_dict().items() if k not in skip}
    b = {k: v for k, v in type(hf.config).from_pretrained(tmp_path / "False").to_dict().items()
         if k not in skip}
    if "max_window_layers" in a:  # inert: no layer is windowed
        a["max_window_layers"] = b["max_window_layers"]
    assert a == b


def test_capacity_drops_are_counted():
    """experts_apply with a capacity: each expert takes its first C assignments in token
    order, the rest are dropped (their tokens get nothing from it) and counted; a
    capacity of every token equals the dropless grouped GEMMs."""
    rng = np.random.default_rng(5)
    N, D, F, E, k = 24, 8, 6, 4, 2
    x = rng.normal(size=(N, D)).astype(np.float32)
    wg, wu = (rng.normal(size=(E, D, F)).astype(np.float32) for _ in range(2))
    wd = rng.normal(size=(E, F, D)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(N)]).astype(np.int32)
    weights = rng.uniform(size=(N, k)).astype(np.float32)
    real = np.arange(N) < N - 3  # the last 3 are padding: no group, no capacity

    def reference(C):
        y, taken, dropped = np.zeros((N, D), np.float32), np.zeros(E, int), 0
        for n in range(N):
            for j in range(k):
                e = ids[n, j]
                if not real[n]:
                    continue
                if taken[e] >= C:
                    dropped += 1
                    continue
                taken[e] += 1
                g, u = x[n] @ wg[e], x[n] @ wu[e]
                y[n] += weights[n, j] * ((g / (1 + np.exp(-g)) * u) @ wd[e])
        return y, dropped

    args = tuple(map(jnp.asarray, (x, ids, weights, real, wg, wu, wd)))
    run = jax.jit(experts_apply, static_argnames="capacity_factor")
    dropless, sizes, none = run(*args)
    assert int(none) == 0 and int(sizes.sum()) == k * real.sum()
    for factor in (0.5, 1.0, E / k):
        y, _, dropped = run(*args, capacity_factor=factor)
        want, n_dropped = reference(capacity_of(N, k, E, factor))
        assert int(dropped) == n_dropped and (n_dropped > 0) == (factor < E / k)
        assert np.abs(np.asarray(y) - want).max() <= 1e-4
    assert np.abs(np.asarray(dropless) - reference(N)[0]).max() <= 1e-4


def test_family_refusals():
    hf = transformers.Qwen3MoeConfig(**SHAPE, head_dim=8).to_dict()
    with pytest.raises(ValueError, match="'qwen3_moe'.*o_proj / MLP bias"):
        config_from_hf({**hf, "attention_bias": True})
    with pytest.raises(ValueError, match="LoRA targets.*qwen3_moe"):  # where it is built
        resolve_config(MoEDecoderConfig.tiny(lora=dict(targets=("q", "gate"))))
    with pytest.raises(ValueError, match="no layer is a mixture of experts"):
        MoEDecoderConfig.tiny(num_layers=1, mlp_only_layers=(0,))
    with pytest.raises(ValueError, match="shared expert"):
        MoEDecoderConfig.tiny(shared_expert_intermediate_size=8).to_hf_config()
