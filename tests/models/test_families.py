"""Qwen2 / Qwen2.5 and Mistral (models/families.py) against transformers' own models.

Qwen2ForCausalLM and MistralForCausalLM are built from their config classes at
tiny shapes (GQA, Qwen2's q/k/v biases, Mistral's sliding window smaller than
the sequence so the window matters), with random fp32 weights of std 0.1 and
perturbed norms and biases so every tensor matters. Tolerance: log-probs
within 1e-5 (fp32), for the packed-row forward, for prefill + decode through
`Decoder.decode` and for the model with stacked layers. The HF round trip
(HF save -> our load -> our save) gives bit-identical tensors and config.
"""

import asyncio

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from ac2_jax.models import DecoderConfig  # noqa: E402
from ac2_jax.models.family import config_from_hf  # noqa: E402
from ac2_jax.models.io.hf_io import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402

TOL = 1e-5
VOCAB = 89
WINDOW = 5

SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
             rms_norm_eps=1e-6, max_position_embeddings=256)
CASES = {  # name: (config class, extra kwargs)
    "qwen2-tied": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen2.5-untied": (transformers.Qwen2Config, dict(
        tie_word_embeddings=False, use_sliding_window=False, sliding_window=32768,
        max_window_layers=1, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "mistral-window": (transformers.MistralConfig, dict(sliding_window=WINDOW, head_dim=8)),
    "mistral-no-window": (transformers.MistralConfig, dict(sliding_window=None)),
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


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    hf = hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param.replace(".", "_"))
    hf.save_pretrained(path)
    return request.param, hf, path


def test_config_read_as_the_family(pair):
    case, hf, path = pair
    _, config = load_hf_checkpoint(str(path))
    qwen2 = case.startswith("qwen2")
    assert config.family == ("qwen2" if qwen2 else "mistral")
    assert config.attention_bias == qwen2 and not config.qk_norm
    assert config.sliding_window == (WINDOW if case == "mistral-window" else None)
    assert config.tie_embeddings == hf.config.tie_word_embeddings


def test_packed_rows_logprobs_equal_transformers(pair):
    """Two segments in one row plus padding, each vs transformers on it alone; positions
    restart per segment, so a window counts from the segment's own start."""
    case, hf, path = pair
    model, _ = load_hf_checkpoint(str(path))
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, VOCAB, 19).tolist(), rng.integers(0, VOCAB, 11).tolist()
    ref_a, ref_b = hf_logprobs(hf, a), hf_logprobs(hf, b)
    L = len(a) + len(b) + 4
    tokens, pos, seg = (np.zeros((1, L), np.int32) for _ in range(3))
    tokens[0, :len(a) + len(b)] = a + b
    pos[0, :len(a)], pos[0, len(a):len(a) + len(b)] = np.arange(len(a)), np.arange(len(b))
    seg[0, :len(a)], seg[0, len(a):len(a) + len(b)] = 1, 2
    out = logprobs(forward(model, *map(jnp.asarray, (tokens, pos, seg))))[0]
    assert np.abs(out[:len(a)] - ref_a).max() <= TOL
    assert np.abs(out[len(a):len(a) + len(b)] - ref_b).max() <= TOL
    if case == "mistral-window":  # the window matters: full causal attention differs
        full = hf_model(case)
        full.config.sliding_window = None
        full.model.config.sliding_window = None
        for layer in full.model.layers:
            layer.self_attn.config.sliding_window = None
        assert np.abs(hf_logprobs(full, a) - ref_a).max() > 1e-2


def test_prefill_and_decode_logprobs_equal_transformers(pair):
    """Prefill 7 tokens, then 16 single-token steps through `Decoder.decode`: every
    step's log-probs equal transformers' forward of the whole sequence."""
    _, hf, path = pair
    model, _ = load_hf_checkpoint(str(path))
    tokens = np.random.default_rng(2).integers(0, VOCAB, 23).tolist()
    ref = hf_logprobs(hf, tokens)
    step = nnx.jit(lambda m, t, p, c: m.decode(t, p, c))
    cache = model.init_cache(1, 32)
    n = 7
    logits, cache = step(model, jnp.asarray([tokens[:n]]), jnp.arange(n)[None], cache)
    got = [logprobs(logits)[0]]
    for p in range(n, len(tokens)):
        logits, cache = step(model, jnp.asarray([[tokens[p]]]), jnp.asarray([[p]]), cache)
        got.append(logprobs(logits)[0])
    assert np.abs(np.concatenate(got) - ref).max() <= TOL


def test_scanned_layers_equal_transformers(pair):
    _, hf, path = pair
    model, config = load_hf_checkpoint(str(path), scan_layers=True)
    assert model.layers.self_attn.q_proj[...].shape[0] == config.num_layers
    tokens = np.random.default_rng(3).integers(0, VOCAB, 17).tolist()
    t = jnp.asarray([tokens])
    out = logprobs(forward(model, t, jnp.arange(len(tokens))[None], jnp.ones_like(t)))[0]
    assert np.abs(out - hf_logprobs(hf, tokens)).max() <= TOL


def test_hf_round_trip_is_bit_exact(pair, tmp_path):
    """HF save -> our load -> our save: the same tensors, bit for bit, and a config.json
    that transformers reads back to the same config; our config survives it too."""
    _, hf, path = pair
    model, config = load_hf_checkpoint(str(path))
    save_hf_checkpoint(model, str(tmp_path))
    theirs, ours = load_file(path / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    if hf.config.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert sorted(theirs) == sorted(ours)
    for name in theirs:
        assert theirs[name].dtype == ours[name].dtype
        assert theirs[name].tobytes() == ours[name].tobytes(), name
    back, back_config = load_hf_checkpoint(str(tmp_path))
    assert back_config == config
    skip = {"transformers_version", "architectures", "_name_or_path", "dtype"}
    a = {k: v for k, v in hf.config.to_dict().items() if k not in skip}
    b = {k: v for k, v in type(hf.config).from_pretrained(tmp_path).to_dict().items()
         if k not in skip}
    if a.get("use_sliding_window") is False:  # inert when no layer is windowed
        a["max_window_layers"] = b["max_window_layers"]
    assert a == b


def test_unsupported_fields_are_named():
    base = transformers.Qwen2Config(**SHAPE).to_dict()
    windowed = {**base, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    windowed.pop("layer_types")
    with pytest.raises(ValueError, match=r"sliding-window layers \[1\].*max_window_layers=1"):
        config_from_hf(windowed)
    mistral = transformers.MistralConfig(**SHAPE).to_dict()
    with pytest.raises(ValueError, match="layer_types"):
        config_from_hf({**mistral, "layer_types": ["sliding_attention", "full_attention"]})
    with pytest.raises(ValueError, match="o_proj / MLP bias"):
        config_from_hf({**mistral, "mlp_bias": True})
    bad = DecoderConfig.tiny(family="qwen2", qk_norm=False, attention_bias=False)
    with pytest.raises(ValueError, match="Qwen2ForCausalLM has attention_bias=True"):
        bad.to_hf_config()
    with pytest.raises(ValueError, match="use family 'mistral'"):
        DecoderConfig.tiny(family="llama", qk_norm=False, sliding_window=4).to_hf_config()


def test_window_mask_blocksparse_and_tiles():
    """The sliding-window mask by positions: dense() is the rule written out, the
    tiles a blocked kernel keeps cover every visible pair and skip far ones, and the
    block-sparse kernel equals dense attention (fp32, 1e-5) on flat and tree rows."""
    from ac2_jax.models.kernels.attention import attention
    from ac2_jax.models.kernels.attention_mask import AttentionMask
    from ac2_jax.models.kernels.blocksparse import blocksparse_attention_with_count

    L, W, blk = 64, 6, 8
    seg = np.zeros((1, L), np.int32)
    seg[0, :40], seg[0, 40:60] = 1, 2
    pos = np.where(np.arange(L) < 40, np.arange(L), np.arange(L) - 40)[None].astype(np.int32)
    mask = AttentionMask.packed(jnp.asarray(seg), positions=jnp.asarray(pos), window=W)
    dense = np.asarray(mask.dense())[0]
    i, j = np.arange(L)[:, None], np.arange(L)[None]
    rule = (i == j) | ((j <= i) & (seg[0][:, None] == seg[0][None]) & (seg[0][:, None] > 0)
                       & (pos[0][:, None] - pos[0][None] < W))
    np.testing.assert_array_equal(dense, rule)
    tiles = np.asarray(mask.tiles(blk, blk))[0]
    covered = np.kron(tiles, np.ones((blk, blk), bool))
    assert not (dense & ~covered).any()
    no_window = np.asarray(AttentionMask.packed(jnp.asarray(seg)).tiles(blk, blk))[0]
    assert tiles.sum() < no_window.sum()
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, L, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, L, 2, 8)), jnp.float32) for _ in range(2))
    ref = attention(q, k, v, mask, backend="dense")
    out, count = blocksparse_attention_with_count(q, k, v, mask, block_q=blk, block_k=blk)
    assert np.abs(np.asarray(out - ref)).max() <= TOL and int(count) == tiles.sum()
    # Tree rows: the window counts positions (depths), not row indices.
    end = jnp.asarray(np.r_[np.full(40, 39), np.full(24, 63)][None].astype(np.int32))
    tree = AttentionMask.packed(jnp.asarray(seg), end, positions=jnp.asarray(pos), window=W)
    ref = attention(q, k, v, tree, backend="dense")
    out, _ = blocksparse_attention_with_count(q, k, v, tree, block_q=blk, block_k=blk)
    assert np.abs(np.asarray(out - ref)).max() <= TOL


def test_blocksparse_window_in_the_decoder_equals_transformers(tmp_path):
    hf = hf_model("mistral-window", seed=5)
    hf.save_pretrained(tmp_path)
    model, _ = load_hf_checkpoint(str(tmp_path), attention_backend="blocksparse",
                                  attention_block=8)
    tokens = np.random.default_rng(4).integers(0, VOCAB, 40).tolist()
    t = jnp.asarray([tokens])
    out = logprobs(forward(model, t, jnp.arange(len(tokens))[None], jnp.ones_like(t)))[0]
    assert np.abs(out - hf_logprobs(hf, tokens)).max() <= TOL


def test_sliding_window_ring_cache_stays_at_the_window(tmp_path):
    """Mistral with window 5: a cache for 64 positions is a ring of 5 slots per layer, and
    its memory stays there while two rows grow to 41 positions, through chunks longer
    than the window (prefills of 7, again after 16 steps: one chunk shape) and single steps, one row
    left-padded. Every log-prob equals transformers' dense forward (1e-5), per-layer
    and with stacked layers; a resize to more positions keeps the ring."""
    from ac2_jax.sampling.engine.decode_loop import resize_cache

    hf = hf_model("mistral-window", seed=7)
    hf.save_pretrained(tmp_path)
    rng = np.random.default_rng(8)
    seqs = [rng.integers(0, VOCAB, 41).tolist(), rng.integers(0, VOCAB, 38).tolist()]
    refs = [hf_logprobs(hf, s) for s in seqs]
    step = nnx.jit(lambda m, t, p, c: m.decode(t, p, c))
    for scan in (False, True):
        model, _ = load_hf_checkpoint(str(tmp_path), scan_layers=scan)
        cache = model.init_cache(2, 64)
        assert cache.ring and cache.slots == WINDOW and cache.max_len == 64
        nbytes = sum(x.nbytes for x in jax.tree.leaves(cache))
        shapes = [x.shape for x in jax.tree.leaves(cache)]
        got: list[list] = [[], []]
        offset = [0, 3]  # row 1 runs 3 positions behind, left-padded with -1 in each chunk

        def run(cache, length, a):
            T = length
            toks, pos = np.zeros((2, T), np.int32), np.full((2, T), -1, np.int32)
            for r in range(2):
                ps = [p for p in range(a - offset[r], a - offset[r] + T) if 0 <= p < len(seqs[r])]
                if ps:
                    toks[r, T - len(ps):] = [seqs[r][p] for p in ps]
                    pos[r, T - len(ps):] = ps
            logits, cache = step(model, jnp.asarray(toks), jnp.asarray(pos), cache)
            lp = logprobs(logits)
            for r in range(2):
                got[r].extend(lp[r, t] for t in range(T) if pos[r, t] >= 0)
            return cache

        a = 0
        for T in [7] + [1] * 16 + [7] + [1] * 11:
            cache = run(cache, T, a)
            a += T
            assert [x.shape for x in jax.tree.leaves(cache)] == shapes
            assert sum(x.nbytes for x in jax.tree.leaves(cache)) == nbytes
        for r in range(2):
            n = len(got[r])
            assert n > 30 and np.abs(np.stack(got[r]) - refs[r][:n]).max() <= TOL
        bigger = resize_cache(cache, jnp.arange(2), max_len=128)
        assert bigger.slots == WINDOW and bigger.max_len == 128
        small = model.init_cache(2, 4)  # fewer positions than the window: plain slots
        assert not small.ring and small.slots == 4
        assert resize_cache(small, jnp.arange(2), max_len=32).slots == WINDOW


def test_jax_sampler_with_a_window_equals_transformers(tmp_path):
    """The embedded sampler on Mistral with window 5: its rows are rings of 5 slots, and
    the log-prob of every sampled token equals transformers' dense forward of the whole
    sequence (1e-5), for prompts shorter and longer than the window, batched."""
    from ac2_jax.sampling import SamplingParams
    from ac2_jax.sampling.engine.jax_sampler import JaxSampler

    hf = hf_model("mistral-window", seed=9)
    hf.save_pretrained(tmp_path)
    model, _ = load_hf_checkpoint(str(tmp_path))
    sampler = JaxSampler(model, max_context=64, max_batch=4, min_batch=4, min_cache_len=64,
                         steps_per_sync=4, prefill_chunk=8, seed=0, max_top_logprobs=0)
    try:
        prompts = [[3, 4, 5], list(range(10, 30)), list(range(40, 51))]
        params = SamplingParams(temperature=1.0, max_tokens=20, seed=1)

        async def go():
            return await asyncio.gather(*(sampler.generate(p, params) for p in prompts))

        results = asyncio.run(go())
        assert sampler._cache.ring and sampler._cache.slots == WINDOW
        for p, r in zip(prompts, results):
            seq = p + list(r.output_ids)
            ref = hf_logprobs(hf, seq)[len(p) - 1:-1]
            want = ref[np.arange(len(r.output_ids)), r.output_ids]
            assert len(r.output_ids) == 20
            assert np.abs(np.asarray(r.output_logprobs) - want).max() <= TOL
    finally:
        sampler.close()
