"""Gemma 3 (models/gemma3.py, family "gemma3_text") against transformers' Gemma3ForCausalLM.

A tiny `Gemma3TextConfig` of the real one's structure: 4 layers, sliding and
full ones mixed (sliding, full, sliding, sliding), a sliding window of 5 below
the sequence lengths, GQA (4 heads, 2 KV heads), query_pre_attn_scalar 12 (not
head_dim), two RoPE bases far apart with linear scaling on the full layers,
tied embeddings; random fp32 weights of std 0.1 and perturbed norms (Gemma's
start at zero). Log-probs within 1e-5 (fp32) for packed rows, prefill + decode
(two rows, one left-padded), stacked layers (forward and decode), the
block-sparse kernel and the embedded sampler; the sliding layers' KV cache is a
ring of the window whose memory stays put while rows grow to 9 windows, decoding
as the dense forward does (also across a resize); the HF round trip is bit-exact;
random LoRA adapters exported with `save_peft_adapter` give PEFT's log-probs.
Also: the config.json form Gemma 3 checkpoints shipped with, the refusals, and
Gemma's chat template rendered as transformers renders it.
"""

import asyncio
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from ac2_jax.models.family import config_from_hf  # noqa: E402
from ac2_jax.models.gemma3 import Gemma3, Gemma3Config  # noqa: E402
from ac2_jax.models.io.hf_io import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from ac2_jax.models.io.peft_io import save_peft_adapter  # noqa: E402
from ac2_jax.models.lora import LoRAConfig  # noqa: E402

TOL = 1e-5
VOCAB = 89
WINDOW = 5
S, F = "sliding_attention", "full_attention"
HF_CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    layer_types=[S, F, S, S],
    sliding_window=WINDOW,
    query_pre_attn_scalar=12,
    rope_parameters={
        F: {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        S: {"rope_type": "default", "rope_theta": 100.0},
    },
    initializer_range=0.1,
    max_position_embeddings=256,
)


def hf_model(seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Gemma3TextConfig(**HF_CONFIG), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def hf_logprobs(model, tokens):
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits, -1).numpy()


def logprobs(logits):
    return np.asarray(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), -1))


@nnx.jit
def forward(model, tokens, positions, segment_ids):
    return model(tokens, positions, segment_ids)


@nnx.jit
def step(model, tokens, positions, cache):
    return model.decode(tokens, positions, cache)


ROW = 48  # every full forward is one row of this length (padding: segment 0): one compile


def one_row(model, tokens):
    """Log-probs [len(tokens), VOCAB] of `tokens` alone, right-padded to ROW."""
    n = len(tokens)
    t, pos, seg = (np.zeros((1, ROW), np.int32) for _ in range(3))
    t[0, :n], pos[0, :n], seg[0, :n] = tokens, np.arange(n), 1
    return logprobs(forward(model, *map(jnp.asarray, (t, pos, seg))))[0, :n]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_model()
    path = tmp_path_factory.mktemp("gemma3")
    hf.save_pretrained(path)
    return hf, path


def test_config_is_read_as_gemma3(pair):
    hf, path = pair
    model, config = load_hf_checkpoint(str(path))
    assert isinstance(model, Gemma3) and isinstance(config, Gemma3Config)
    assert config.layer_types == (S, F, S, S) and config.sliding_window == WINDOW
    assert (config.rope_theta, config.rope_local_theta) == (10000.0, 100.0)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.query_pre_attn_scalar == 12 and config.tie_embeddings


def test_packed_rows_logprobs_equal_transformers(pair):
    """Two segments in one row plus padding, each vs transformers on it alone (positions
    restart per segment, so a window counts from the segment's start). The window and
    the local RoPE base matter: without either the log-probs move."""
    hf, path = pair
    model, config = load_hf_checkpoint(str(path))
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, VOCAB, 19).tolist(), rng.integers(0, VOCAB, 11).tolist()
    ref_a, ref_b = hf_logprobs(hf, a), hf_logprobs(hf, b)
    tokens, pos, seg = (np.zeros((1, ROW), np.int32) for _ in range(3))
    tokens[0, : len(a) + len(b)] = a + b
    pos[0, : len(a)], pos[0, len(a) : len(a) + len(b)] = np.arange(len(a)), np.arange(len(b))
    seg[0, : len(a)], seg[0, len(a) : len(a) + len(b)] = 1, 2
    out = logprobs(forward(model, *map(jnp.asarray, (tokens, pos, seg))))[0]
    assert np.abs(out[: len(a)] - ref_a).max() <= TOL
    assert np.abs(out[len(a) : len(a) + len(b)] - ref_b).max() <= TOL
    state = nnx.state(model)
    for change in (dict(sliding_window=None), dict(rope_local_theta=config.rope_theta)):
        shape = nnx.eval_shape(lambda change=change: Gemma3(config.replace(**change)))
        other = nnx.merge(nnx.graphdef(shape), state)
        assert np.abs(one_row(other, a) - ref_a).max() > 1e-3, change


def test_prefill_and_decode_logprobs_equal_transformers(pair):
    """Two rows through `decode`: a prefill of 11 (row 1: 4 tokens, left-padded with -1),
    then single steps; row 1 ends earlier and pads its steps. Every log-prob equals
    transformers' forward of the whole sequence, per-layer and stacked."""
    hf, path = pair
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, VOCAB, 23).tolist(), rng.integers(0, VOCAB, 15).tolist()]
    refs = [hf_logprobs(hf, s) for s in seqs]
    for scan in (False, True):
        model, _ = load_hf_checkpoint(str(path), scan_layers=scan)
        cache = model.init_cache(2, 64)  # the ring test's shapes: compiled once for both
        assert cache.stacked == scan and cache.max_len == 64
        toks = np.zeros((2, 11), np.int32)  # the ring test's chunk width: one compile
        pos = np.full((2, 11), -1, np.int32)
        toks[0], pos[0] = seqs[0][:11], np.arange(11)
        toks[1, 7:], pos[1, 7:] = seqs[1][:4], np.arange(4)
        logits, cache = step(model, jnp.asarray(toks), jnp.asarray(pos), cache)
        lp = logprobs(logits)
        got = [list(lp[0]), list(lp[1, 7:])]
        for i in range(12):
            p = np.array([11 + i, 4 + i if 4 + i < len(seqs[1]) else -1], np.int32)
            t = np.array([seqs[0][p[0]], seqs[1][p[1]] if p[1] >= 0 else 0], np.int32)
            logits, cache = step(model, jnp.asarray(t[:, None]), jnp.asarray(p[:, None]), cache)
            lp = logprobs(logits)
            for r in range(2):
                if p[r] >= 0:
                    got[r].append(lp[r, 0])
        for r in range(2):
            assert len(got[r]) == len(seqs[r])
            assert np.abs(np.stack(got[r]) - refs[r]).max() <= TOL, (scan, r)


def test_sliding_layers_cache_is_a_ring_of_the_window(pair):
    """The sliding layers' cache (3 of 4 layers) is a ring of WINDOW slots when the cache
    is longer, the full layer's is max_len long, and their memory does not move while
    two rows (one 3 positions behind, left-padded) grow to 45 and 42 positions (9
    windows) through chunks longer than the window (11: over twice the ring) and
    single steps, nor across `resize_cache` to 128 positions mid-way (the full layer
    grows, the ring stays). Every log-prob equals the dense forward of the whole row (ours and
    transformers', 1e-5), per-layer and stacked."""
    from ac2_jax.sampling.engine.decode_loop import resize_cache

    hf, path = pair
    rng = np.random.default_rng(6)
    seqs = [rng.integers(0, VOCAB, 45).tolist(), rng.integers(0, VOCAB, 42).tolist()]
    theirs = [hf_logprobs(hf, s) for s in seqs]
    offset = [0, 3]

    def slots(part):
        return {x.shape[part.seq_axis] for x in jax.tree.leaves(part)}

    for scan in (False, True):
        model, config = load_hf_checkpoint(str(path), scan_layers=scan)
        dense = [one_row(model, s) for s in seqs]
        for r in range(2):
            assert np.abs(dense[r] - theirs[r]).max() <= TOL
        cache = model.init_cache(2, 64)
        assert cache.ring and cache.max_len == 64 and cache.stacked == scan
        assert (cache.sliding.num_layers, cache.full.num_layers) == (3, 1)
        assert slots(cache.sliding) == {WINDOW} and slots(cache.full) == {64}
        long = model.init_cache(2, 4096)  # the ring does not grow with the context
        assert [x.shape for x in jax.tree.leaves(long.sliding)] == [
            x.shape for x in jax.tree.leaves(cache.sliding)
        ]
        got: list[list] = [[], []]
        a = 0
        # one chunk width (11, as the prefill test's) and single steps: two shapes per cache
        for T in [11] + [1] * 10 + [11] + [1] * 6 + ["resize"] + [11] + [1] * 8:
            if T == "resize":
                cache = resize_cache(cache, jnp.arange(2), max_len=128)
                assert slots(cache.sliding) == {WINDOW} and slots(cache.full) == {128}
                assert cache.ring and cache.max_len == 128
                continue
            before = [(x.shape, x.nbytes) for x in jax.tree.leaves(cache)]
            toks, pos = np.zeros((2, T), np.int32), np.full((2, T), -1, np.int32)
            for r in range(2):
                ps = [p for p in range(a - offset[r], a - offset[r] + T) if 0 <= p < len(seqs[r])]
                if ps:
                    toks[r, T - len(ps) :] = [seqs[r][p] for p in ps]
                    pos[r, T - len(ps) :] = ps
            logits, cache = step(model, jnp.asarray(toks), jnp.asarray(pos), cache)
            assert [(x.shape, x.nbytes) for x in jax.tree.leaves(cache)] == before
            lp = logprobs(logits)
            for r in range(2):
                got[r].extend(lp[r, t] for t in range(T) if pos[r, t] >= 0)
            a += T
        for r in range(2):
            n = len(got[r])
            assert n > 8 * WINDOW, n
            assert np.abs(np.stack(got[r]) - dense[r][:n]).max() <= TOL, (scan, r)
            assert np.abs(np.stack(got[r]) - theirs[r][:n]).max() <= TOL, (scan, r)


def test_stacked_layers_and_blocksparse_equal_transformers(pair):
    """Stacked layers (the per-layer window and RoPE are scanned flags), with the dense
    and the block-sparse kernel (tiles of 8 over 40 tokens in a row of 48, per-layer and
    stacked)."""
    hf, path = pair
    tokens = np.random.default_rng(3).integers(0, VOCAB, 40).tolist()
    ref = hf_logprobs(hf, tokens)
    for kw in (
        dict(scan_layers=True),
        dict(attention_backend="blocksparse", attention_block=8),
        dict(attention_backend="blocksparse", attention_block=8, scan_layers=True),
    ):
        model, config = load_hf_checkpoint(str(path), **kw)
        if config.scan_layers:
            assert model.layers.self_attn.q_proj[...].shape[0] == config.num_layers
        assert np.abs(one_row(model, tokens) - ref).max() <= TOL, kw


def test_remat_keeps_gradients(pair):
    """remat="full" under scan: the same loss and gradients as without."""
    _, path = pair
    t = jnp.asarray([np.random.default_rng(4).integers(0, VOCAB, 16)])
    pos = jnp.arange(16)[None]

    @nnx.jit
    def grads(model):
        def loss(m):
            lp = jax.nn.log_softmax(m(t, pos, jnp.ones_like(t)), -1)
            return -jnp.take_along_axis(lp[:, :-1], t[:, 1:, None], -1).mean()

        return nnx.grad(loss)(model)

    a = grads(load_hf_checkpoint(str(path), scan_layers=True)[0])
    b = grads(load_hf_checkpoint(str(path), scan_layers=True, remat="full")[0])
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=0)


def test_hf_round_trip_is_bit_exact(pair, tmp_path):
    """HF save -> our load -> our save (per-layer and stacked): the same tensors, bit for
    bit, and a config.json transformers reads back to the same config; ours survives."""
    hf, path = pair
    theirs = load_file(path / "model.safetensors")
    theirs.pop("lm_head.weight", None)  # tied
    for scan in (False, True):
        model, config = load_hf_checkpoint(str(path), scan_layers=scan)
        out = tmp_path / f"scan{scan}"
        save_hf_checkpoint(model, str(out))
        ours = load_file(out / "model.safetensors")
        assert sorted(theirs) == sorted(ours)
        assert "model.layers.3.pre_feedforward_layernorm.weight" in ours
        for name in theirs:
            assert theirs[name].dtype == ours[name].dtype
            assert theirs[name].tobytes() == ours[name].tobytes(), name
        _, back = load_hf_checkpoint(str(out), scan_layers=scan)
        assert back == config
    skip = {"transformers_version", "architectures", "_name_or_path", "dtype"}
    a = {k: v for k, v in hf.config.to_dict().items() if k not in skip}
    read = transformers.Gemma3TextConfig.from_pretrained(tmp_path / "scanFalse")
    b = {k: v for k, v in read.to_dict().items() if k not in skip}
    assert a == b


def test_lora_export_loads_in_peft_with_same_logprobs(pair, tmp_path):
    """Random adapters on q, k, v, o, gate, up, down (stacked layers), exported with
    `save_peft_adapter`, loaded by `peft.PeftModel.from_pretrained` on transformers'
    model: the same log-probs (1e-5), and the adapter matters."""
    hf, path = pair
    lora = LoRAConfig(rank=4, alpha=8.0)
    model, config = load_hf_checkpoint(str(path), lora=lora, scan_layers=True)
    tokens = np.random.default_rng(5).integers(0, VOCAB, 17).tolist()
    base = one_row(model, tokens)
    state = nnx.state(model, nnx.LoRAParam)
    leaves, tree = jax.tree.flatten(state)
    assert len(leaves) == 2 * 7
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    new = [0.05 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    nnx.update(model, jax.tree.unflatten(tree, new))
    ours = one_row(model, tokens)
    save_peft_adapter(model, str(tmp_path / "adapter"), base_model_name_or_path=str(path))
    base_hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    peft_model = peft.PeftModel.from_pretrained(base_hf, str(tmp_path / "adapter")).eval()
    theirs = hf_logprobs(peft_model, tokens)
    assert np.abs(theirs - base).max() > 1e-3  # the adapter matters
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)


def test_jax_sampler_equals_transformers(pair):
    """The embedded sampler on Gemma 3 (its sliding layers' rows are rings of the window,
    the full layer's grow as the sampler resizes the cache from 8 positions): the
    log-prob of every sampled token equals transformers' forward (1e-5), batched.
    """
    from ac2_jax.sampling import SamplingParams
    from ac2_jax.sampling.engine.jax_sampler import JaxSampler

    hf, path = pair
    model, _ = load_hf_checkpoint(str(path))
    sampler = JaxSampler(
        model,
        max_context=48,
        max_batch=2,
        min_batch=2,
        min_cache_len=8,
        steps_per_sync=4,
        prefill_chunk=8,
        seed=0,
        max_top_logprobs=0,
    )
    try:
        prompts = [[3, 4, 5], list(range(10, 21))]
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=1)

        async def go():
            return await asyncio.gather(*(sampler.generate(p, params) for p in prompts))

        results = asyncio.run(go())
        cache = sampler._cache
        assert sampler.stats.resizes >= 1 and cache.ring and cache.max_len > 8
        sliding, full = cache.sliding, cache.full
        assert {x.shape[sliding.seq_axis] for x in jax.tree.leaves(sliding)} == {WINDOW}
        assert {x.shape[full.seq_axis] for x in jax.tree.leaves(full)} == {cache.max_len}
        for p, r in zip(prompts, results, strict=True):
            ref = hf_logprobs(hf, p + list(r.output_ids))[len(p) - 1 : -1]
            want = ref[np.arange(len(r.output_ids)), r.output_ids]
            assert len(r.output_ids) == 12
            assert np.abs(np.asarray(r.output_logprobs) - want).max() <= TOL
        # A short request after them: the cache shrinks back to 8 positions, rings
        # included, and the log-probs still match.
        short = asyncio.run(sampler.generate([7, 8], params.replace(max_tokens=3)))
        assert sampler.stats.cache_shrinks == 1 and sampler._cache.max_len == 8
        ref = hf_logprobs(hf, [7, 8] + list(short.output_ids))[1:-1]
        want = ref[np.arange(3), short.output_ids]
        assert np.abs(np.asarray(short.output_logprobs) - want).max() <= TOL
    finally:
        sampler.close()


# The config.json google/gemma-3-1b-pt shipped with (transformers 4.50's form).
SHIPPED = {
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 262144,
}


def test_shipped_config_form_and_refusals():
    """The shipped form reads as transformers reads it (layer types, both RoPE bases, a
    4B-style linear scaling) and writes back in transformers 5's form; what Gemma 3
    never sets is refused by name."""
    config = config_from_hf(SHIPPED)
    theirs = transformers.Gemma3TextConfig(**{k: v for k, v in SHIPPED.items() if k != "dtype"})
    assert list(config.layer_types) == theirs.layer_types
    assert config.layer_types[5] == F and config.layer_types.count(F) == 4
    assert config.rope_theta == theirs.rope_parameters[F]["rope_theta"] == 1e6
    assert config.rope_local_theta == theirs.rope_parameters[S]["rope_theta"] == 1e4
    assert config.eos_token_id == (1, 106) and config.rope_scaling is None
    assert config_from_hf(config.to_hf_config()) == config
    scaled = config_from_hf({**SHIPPED, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert scaled.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    written = scaled.to_hf_config()["rope_parameters"][F]
    assert written == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    for field, value, match in (
        ("final_logit_softcapping", 30.0, "final_logit_softcapping"),
        ("use_bidirectional_attention", True, "use_bidirectional_attention"),
        ("hidden_activation", "silu", "hidden_activation"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "yarn"),
    ):
        with pytest.raises(ValueError, match=match):
            config_from_hf({**SHIPPED, field: value})
    with pytest.raises(ValueError, match="mlp_backward must be 'autodiff'"):
        Gemma3Config.tiny(mlp_backward="custom")
    with pytest.raises(ValueError, match="layer_types"):
        Gemma3Config.tiny(layer_types=(S, F))


# Gemma 3's chat template, written for this test from the structure of the one its
# instruction-tuned tokenizers ship (system text folded into the first user turn,
# assistant -> "model", <start_of_turn> / <end_of_turn>); not copied byte for byte.
GEMMA3_TEMPLATE = """\
{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- else -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""


def test_chat_template_renders_as_transformers(tmp_path):
    from tokenizers import AddedToken, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    from ac2_jax.text.tokenizer import Tokenizer

    added = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.train_from_iterator(
        ["the weather in Paris is sunny", "model user"] * 20,
        trainer=trainers.BpeTrainer(
            vocab_size=300,
            show_progress=False,
            special_tokens=added,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    Tokenizer(hf, chat_template=GEMMA3_TEMPLATE, special_tokens=special).save_pretrained(
        str(tmp_path)
    )
    ours = Tokenizer.from_pretrained(str(tmp_path))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " Hi é "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Paris?"}]},
    ]
    for m in (msgs, msgs[1:]):
        for gen in (True, False):
            text = ours.apply_chat_template(m, None, gen)
            assert text == theirs.apply_chat_template(m, add_generation_prompt=gen, tokenize=False)
    text = ours.apply_chat_template(msgs, None, True)
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\nHi é<end_of_turn>\n")
    assert text.endswith("Paris?<end_of_turn>\n<start_of_turn>model\n")
    ids = ours.apply_chat_template(msgs, tokenize=True)
    assert ids == theirs.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    with pytest.raises(Exception, match="alternate"):
        ours.apply_chat_template([*msgs[:2], msgs[1]])
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["chat_template"]
