"""Decoder: packing equivalences, merged-episode equivalence, KV cache, sharding,
scanned vs per-layer layers, remat policies, bf16 compute with fp32 master weights.

fp32 unless stated. Tolerances: per-token log-probs 1e-5; KV-cache logits 1e-4;
scanned vs per-layer (and block-sparse vs dense attention) logits, gradients and
decode 1e-5; bf16 compute vs fp32 logits: max |difference| <= 5% of max |logit|
(bf16 keeps 8 bits of mantissa; these weights make activations large).
Weights use std 0.2 so attention patterns matter (checked by negative controls).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ac2_jax.losses import token_logprobs
from ac2_jax.models import Decoder, DecoderConfig, to_layout, with_layout
from ac2_jax.segments import Segment, pack_segments, segments_from_trace
from ac2_jax.trace import Completion, Trace, TraceRecorder
from ac2_jax.training.rl import rl_segment

V = 64  # divisible by the mesh axes of the sharding test


@pytest.fixture(scope="module")
def model():
    return Decoder(DecoderConfig.tiny(V, initializer_range=0.2, tie_embeddings=False),
                   rngs=nnx.Rngs(1))


@nnx.jit
def forward(model, tokens, positions, segment_ids):
    return model(tokens, positions, segment_ids)


@nnx.jit
def decode(model, tokens, positions, cache):
    return model.decode(tokens, positions, cache)


@nnx.jit
def prefill_last(model, tokens, positions, cache, last):
    return model.decode(tokens, positions, cache, logits_at=last)


ROWS, L = 4, 40  # every full forward runs at this one shape: one compile


def pad(a, value=0):
    """[r, n] -> [ROWS, L], padded with `value`."""
    a = np.asarray(a)
    out = np.full((ROWS, L), value, a.dtype)
    out[:a.shape[0], :a.shape[1]] = a
    return out


def logprobs(model, tokens, positions, segment_ids, targets):
    logits = forward(model, jnp.asarray(pad(tokens)), jnp.asarray(pad(positions)),
                     jnp.asarray(pad(segment_ids)))
    return np.asarray(token_logprobs(logits, jnp.asarray(pad(targets))))


def test_packed_segments_equal_alone(model):
    rng = np.random.default_rng(0)
    lengths = [11, 7, 13]
    seqs = [rng.integers(0, V, n) for n in lengths]
    # Row 0: the three segments packed; rows 1..3: each segment alone.
    tokens, pos, seg, tgt = (np.zeros((ROWS, L), np.int32) for _ in range(4))
    start = 0
    for i, s in enumerate(seqs):
        n = len(s)
        for r, at in ((0, start), (i + 1, 0)):
            tokens[r, at:at + n] = s
            tgt[r, at:at + n - 1] = s[1:]
            pos[r, at:at + n] = np.arange(n)
            seg[r, at:at + n] = i + 1 if r == 0 else 1
        start += n
    lp = logprobs(model, tokens, pos, seg, tgt)
    start = 0
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(lp[0, start:start + n - 1], lp[i + 1, :n - 1],
                                   atol=1e-5, rtol=0)
        start += n
    # Negative control: without segment separation the later segments change.
    mixed = logprobs(model, tokens, pos, (seg > 0).astype(np.int32), tgt)
    total = sum(lengths)
    assert np.abs(mixed[0, lengths[0]:total - 1] - lp[0, lengths[0]:total - 1]).max() > 1e-3


def test_merged_episode_equals_per_request(model):
    rng = np.random.default_rng(1)
    rand = lambda n: rng.integers(0, V, n).tolist()  # noqa: E731
    trace = Trace(task_id="t", attempt_id="0")
    rec = TraceRecorder(trace)
    prompt = rand(6)
    for _ in range(4):
        out = rand(int(rng.integers(2, 6)))
        rec.record("main", Completion(prompt_ids=prompt, output_ids=out,
                                      output_logprobs=[-1.0] * len(out)))
        prompt = prompt + out + rand(int(rng.integers(2, 4)))
    assert len(trace.episodes) == 1 and len(trace.episodes[0].completions) == 4

    def agent_logprobs(mode):
        batch = pack_segments(segments_from_trace(trace, mode=mode), L, min_rows=ROWS)
        assert batch.shape == (ROWS, L)
        lp = logprobs(model, batch.tokens, batch.positions, batch.segment_ids, batch.targets)
        m = batch.loss_mask > 0
        return [(int(s), int(p), float(x)) for s, p, x in
                zip(batch.segment_index[m], batch.positions[m], lp[m])]

    merged = {p: x for _, p, x in agent_logprobs("episode")}
    per_request = agent_logprobs("request")
    # Request j's tokens sit at the same positions as in the episode
    # (append-only), so every agent token is compared by its position.
    assert len(merged) == trace.episodes[0].num_agent_tokens
    assert {p for _, p, _ in per_request} == set(merged)
    assert len({s for s, _, _ in per_request}) == 4
    assert max(abs(x - merged[p]) for _, p, x in per_request) <= 1e-5


def _reference_rows(model, rows):
    """Full-forward logits of each row alone (one row each, right-padded)."""
    tokens, pos, seg = (np.zeros((len(rows), L), np.int32) for _ in range(3))
    for b, r in enumerate(rows):
        tokens[b, :len(r)], pos[b, :len(r)], seg[b, :len(r)] = r, np.arange(len(r)), 1
    lg = forward(model, jnp.asarray(pad(tokens)), jnp.asarray(pad(pos)), jnp.asarray(pad(seg)))
    return [np.asarray(lg)[b, :len(r)] for b, r in enumerate(rows)]


B, T, S = 3, 9, 32  # decode batch, prefill width, cache length (shared: few compiles)


@pytest.mark.parametrize("padding", ["right", "left"])
def test_kv_cache_matches_full_forward(model, padding):
    rng = np.random.default_rng(2)
    prompt_lens, steps = [5, 9, 7], 6
    rows = [rng.integers(0, V, n + steps).tolist() for n in prompt_lens]
    ref = _reference_rows(model, rows)
    tokens = np.zeros((B, T), np.int32)
    pos = np.full((B, T), -1, np.int32)
    last = np.zeros(B, np.int32)
    for b, n in enumerate(prompt_lens):
        off = 0 if padding == "right" else T - n
        tokens[b, off:off + n] = rows[b][:n]
        pos[b, off:off + n] = np.arange(n)
        last[b] = off + n - 1
    cache = model.init_cache(B, S)
    logits, cache = decode(model, jnp.asarray(tokens), jnp.asarray(pos), cache)
    logits = np.asarray(logits)
    for b, n in enumerate(prompt_lens):
        off = 0 if padding == "right" else T - n
        np.testing.assert_allclose(logits[b, off:off + n], ref[b][:n], atol=1e-4, rtol=0)
    # Each row then steps one token at a time from its own position.
    for s in range(steps):
        tok = np.array([[rows[b][n + s]] for b, n in enumerate(prompt_lens)], np.int32)
        p = np.array([[n + s] for n in prompt_lens], np.int32)
        step_logits, cache = decode(model, jnp.asarray(tok), jnp.asarray(p), cache)
        for b, n in enumerate(prompt_lens):
            np.testing.assert_allclose(np.asarray(step_logits)[b, 0], ref[b][n + s],
                                       atol=1e-4, rtol=0)
    # logits_at picks each row's last prompt token.
    last_logits, _ = prefill_last(model, jnp.asarray(tokens), jnp.asarray(pos),
                                  model.init_cache(B, S), jnp.asarray(last))
    assert last_logits.shape == (B, V)
    for b, n in enumerate(prompt_lens):
        np.testing.assert_allclose(np.asarray(last_logits)[b], ref[b][n - 1], atol=1e-4, rtol=0)


def test_kv_cache_reused_row_and_chunked_prefill(model):
    rng = np.random.default_rng(3)
    cache = model.init_cache(B, S)
    pos = np.tile(np.arange(T), (B, 1)).astype(np.int32)
    _, cache = decode(model, jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32),
                      jnp.asarray(pos), cache)
    for s in range(3):  # slots 9..11 too, so stale slots lie past the new prompts
        # int32, not weak-typed: the [B, 1] step program of the test above, not a new one
        pos1 = jnp.full((B, 1), T + s, jnp.int32)
        _, cache = decode(model, jnp.full((B, 1), 1, jnp.int32), pos1, cache)
    # Reuse the rows for new requests: row 0 a shorter prompt in one call,
    # row 1 a longer prompt in two chunks (positions continue across calls),
    # row 2 keeps decoding its old request.
    new = [rng.integers(0, V, 4).tolist(), rng.integers(0, V, 14).tolist()]
    ref = _reference_rows(model, new)
    tokens = np.zeros((B, T), np.int32)
    pos = np.full((B, T), -1, np.int32)
    tokens[0, :4], pos[0, :4] = new[0], np.arange(4)
    tokens[1], pos[1] = new[1][:T], np.arange(T)
    logits, cache = decode(model, jnp.asarray(tokens), jnp.asarray(pos), cache)
    np.testing.assert_allclose(np.asarray(logits)[0, :4], ref[0], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(logits)[1], ref[1][:T], atol=1e-4, rtol=0)
    tokens = np.zeros((B, T), np.int32)
    pos = np.full((B, T), -1, np.int32)
    tokens[1, :5], pos[1, :5] = new[1][T:], np.arange(T, 14)
    logits, cache = decode(model, jnp.asarray(tokens), jnp.asarray(pos), cache)
    np.testing.assert_allclose(np.asarray(logits)[1, :5], ref[1][T:], atol=1e-4, rtol=0)
    # Row 0 was all padding in that call: its cache is untouched, its next step exact.
    step, _ = decode(model, jnp.full((B, 1), 7, jnp.int32),
                     jnp.asarray([[4], [14], [T + 3]]), cache)
    ref_step = _reference_rows(model, [new[0] + [7], new[1] + [7]])
    np.testing.assert_allclose(np.asarray(step)[0, 0], ref_step[0][4], atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(step)[1, 0], ref_step[1][14], atol=1e-4, rtol=0)


def test_partition_specs_and_mesh(model):
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    flat = {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(specs)}
    assert all(isinstance(s, P) for s in flat.values())
    # Logical axis names (models.axes); the rules map them to the mesh.
    assert flat["embed_tokens"] == P("vocab", "embed")
    assert flat["lm_head"] == P("embed", "vocab")
    assert flat["layers.0.self_attn.q_proj"] == P("embed", "heads")
    assert flat["layers.1.mlp.down_proj"] == P("mlp", "embed")
    assert flat["norm.weight"] == P(None)
    scanned = nnx.get_partition_spec(nnx.state(with_layout(model, True), nnx.Param))
    flat = {".".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(scanned)}
    assert flat["layers.self_attn.q_proj"] == P("layers", "embed", "heads")
    assert flat["layers.mlp.down_proj"] == P("layers", "mlp", "embed")
    assert flat["layers.input_layernorm.weight"] == P("layers", None)
    # Under a ('data', 'fsdp', 'tensor') mesh params are sharded at creation and
    # the forward pass is the same as without a mesh.
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (forced host) devices")
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    config = model.config
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, V, (ROWS, L)), jnp.int32)
    pos, seg = jnp.tile(jnp.arange(L), (ROWS, 1)), jnp.ones((ROWS, L), jnp.int32)
    with jax.set_mesh(mesh):
        sharded = Decoder(config, rngs=nnx.Rngs(1))
        assert sharded.embed_tokens[...].sharding.spec == P("tensor", "fsdp")
        out = forward(sharded, tokens, pos, seg)
    np.testing.assert_allclose(np.asarray(out), np.asarray(forward(model, tokens, pos, seg)),
                               atol=1e-5, rtol=0)
    stacked = config.replace(scan_layers=True)
    with jax.set_mesh(mesh):  # stacked params: the layer axis replicated, the rest as before
        sharded = Decoder(stacked, rngs=nnx.Rngs(1))
        assert sharded.layers.self_attn.q_proj[...].sharding.spec == P(None, "fsdp", "tensor")
        out = forward(sharded, tokens, pos, seg)
    np.testing.assert_allclose(np.asarray(out), np.asarray(forward(
        Decoder(stacked, rngs=nnx.Rngs(1)), tokens, pos, seg)), atol=1e-5, rtol=0)


def rows_and_loss():
    """Flat packed rows (3 segments and padding per row) and their mean log-prob loss."""
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, V, (ROWS, L)), jnp.int32)
    seg = jnp.asarray(np.repeat([1, 2, 3, 0], [15, 9, 12, 4])[None].repeat(ROWS, 0), jnp.int32)
    pos = jnp.asarray(np.concatenate([np.arange(15), np.arange(9), np.arange(12), np.zeros(4)]
                                     )[None].repeat(ROWS, 0), jnp.int32)

    def loss(m):
        return token_logprobs(m(tokens, pos, seg), tokens).mean()
    return (tokens, pos, seg), loss


@nnx.jit
def grads(m):
    return nnx.grad(rows_and_loss()[1])(m)


def flat_grads(m):
    """Gradients as a pure dict in the stacked layout."""
    return jax.tree.leaves(to_layout(nnx.to_pure_dict(grads(m)), stacked=True))


def assert_close_trees(a, b, atol):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=0)


def test_scanned_layers_equal_per_layer(model):
    """Same weights stacked under jax.lax.scan: same logits, gradients and decode."""
    scanned = with_layout(model, True)
    assert scanned.layers.self_attn.q_proj[...].shape == (2, 32, 32)
    (tokens, pos, seg), _ = rows_and_loss()
    np.testing.assert_allclose(forward(scanned, tokens, pos, seg),
                               forward(model, tokens, pos, seg), atol=1e-5, rtol=0)
    assert_close_trees(flat_grads(scanned), flat_grads(model), atol=1e-5)
    step_tok = jnp.asarray([[3], [5], [7]], jnp.int32)
    prompt_pos = jnp.tile(jnp.arange(T), (B, 1)).at[1, 6:].set(-1)
    for m in (model, scanned):
        logits, c = decode(m, tokens[:B, :T], prompt_pos, m.init_cache(B, S))
        step, c = decode(m, step_tok, jnp.asarray([[T], [6], [T]]), c)
        if m is model:
            ref = (logits, step, c)
    np.testing.assert_allclose(logits, ref[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(step, ref[1], atol=1e-5, rtol=0)
    assert c.k.shape == (B, S, 2, 2 * 8)  # [batch, max_len, layers, kv heads x head_dim]
    assert ref[2].k[0].shape == (B, 2, S, 8)  # per-layer: [batch, kv heads, max_len, head_dim]
    for i in range(2):  # the same keys as the per-layer cache's
        per_layer = jnp.swapaxes(ref[2].k[i], 1, 2).reshape(B, S, 16)
        np.testing.assert_allclose(c.k[:, :, i], per_layer, atol=1e-5, rtol=0)


def test_blocksparse_attention_in_the_decoder_equals_dense(model):
    """Tree rows and flat rows through the scanned model with the block-sparse kernel."""
    sparse = with_layout(model, True, attention_backend="blocksparse", attention_block=16)
    rng = np.random.default_rng(6)
    prompt, branches = rng.integers(0, V, 12).tolist(), [rng.integers(0, V, 6).tolist()
                                                         for _ in range(3)]
    segs = [Segment(prompt + b, [0] * 12 + [1] * 6, task="g") for b in branches]
    batch = pack_segments(segs, L, layout="tree", min_rows=ROWS)
    assert batch.subtree_end is not None and batch.shape == (ROWS, L)

    @nnx.jit
    def tree_logits(m):
        return m(batch.tokens, batch.positions, batch.segment_ids, batch.subtree_end)
    np.testing.assert_allclose(tree_logits(sparse), tree_logits(model), atol=1e-5, rtol=0)
    assert_close_trees(flat_grads(sparse), flat_grads(model), atol=1e-5)


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_policies_same_grads(model, remat):
    assert_close_trees(flat_grads(with_layout(model, True, remat=remat)), flat_grads(model),
                       atol=1e-6)
    assert DecoderConfig.tiny(V, remat=True).remat == "full"  # bools still work
    assert DecoderConfig.tiny(V, remat=False).remat == "none"


@pytest.mark.parametrize("scan_layers,remat", [(False, "none"), (True, "save_dots")])
def test_custom_vjps_same_grads_as_autodiff(model, scan_layers, remat):
    """The MLP's and the projections' custom VJPs (the defaults `mlp_backward` /
    `proj_backward` = "custom") against JAX's autodiff of the same forward, through
    the whole decoder's loss: every parameter's gradient equal to 1e-6 (fp32),
    per-layer and scanned, with and without remat."""
    assert (model.config.mlp_backward, model.config.proj_backward) == ("custom", "custom")
    custom = with_layout(model, scan_layers, remat=remat)
    plain = with_layout(model, scan_layers, remat=remat, mlp_backward="autodiff",
                        proj_backward="autodiff")
    assert_close_trees(flat_grads(custom), flat_grads(plain), atol=1e-6)


def test_bf16_compute_with_fp32_master_weights(model):
    """Params stay fp32, activations bf16, logits fp32 and close to fp32's; a train
    step (PPO loss, AdamW) runs and keeps the params fp32."""
    from ac2_jax.training import (
        OptimizerConfig,
        PolicyGradientLoss,
        create_train_state,
        make_train_step,
    )

    bf16 = with_layout(model, True, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    assert bf16.layers.self_attn.q_proj[...].dtype == jnp.float32
    (tokens, pos, seg), _ = rows_and_loss()
    hidden = nnx.eval_shape(lambda m: m.hidden_states(tokens, pos, seg), bf16)
    assert hidden.dtype == jnp.bfloat16
    logits = forward(bf16, tokens, pos, seg)
    ref = forward(model, tokens, pos, seg)
    assert logits.dtype == jnp.float32
    assert 0 < float(jnp.abs(logits - ref).max()) <= 0.05 * float(jnp.abs(ref).max())
    rng = np.random.default_rng(7)
    segs = [rl_segment(rng.integers(0, V, 20), np.r_[np.zeros(8), np.ones(12)], -np.ones(20),
                    task=f"t{i}", advantage=float(i) - 0.5) for i in range(2)]
    batch = pack_segments(segs, L, min_rows=2)
    graphdef, state = create_train_state(bf16, OptimizerConfig(learning_rate=1e-2))
    step = make_train_step(graphdef, PolicyGradientLoss(old_logprobs="sampler"),
                           OptimizerConfig(learning_rate=1e-2))
    before = jax.device_get(state.params)
    state, metrics = step(step.place(state), batch)
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    after = jax.tree.leaves(jax.device_get(state.params))
    assert all(x.dtype == np.float32 for x in after)
    assert max(float(np.abs(a - b).max()) for a, b in zip(after, jax.tree.leaves(before))) > 0


def test_bad_inputs(model):
    with pytest.raises(ValueError, match="tokens must be"):
        model(jnp.zeros((4,), jnp.int32), jnp.zeros((4,), jnp.int32), jnp.ones((4,), jnp.int32))
    with pytest.raises(ValueError, match="batch"):
        model.decode(jnp.zeros((3, 1), jnp.int32), jnp.zeros((3, 1), jnp.int32),
                     model.init_cache(2, 8))
    with pytest.raises(ValueError, match="num_kv_heads"):
        DecoderConfig.tiny(V, num_heads=3, num_kv_heads=2)
    with pytest.raises(ValueError, match="remat must be one of"):
        DecoderConfig.tiny(V, remat="dots")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        DecoderConfig.tiny(V, attention_backend="flash")
    with pytest.raises(ValueError, match="attention_block"):
        DecoderConfig.tiny(V, attention_block=12)
    with pytest.raises(ValueError, match=r"mlp_backward must be one of \('custom', 'autodiff'\)"):
        DecoderConfig.tiny(V, mlp_backward="manual")
    with pytest.raises(ValueError, match="proj_backward must be one of"):
        DecoderConfig.tiny(V, proj_backward=True)
    with pytest.raises(ValueError, match="per-layer with 3 layers"):  # another model's cache
        model.decode(jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32),
                     Decoder(DecoderConfig.tiny(V, num_layers=3)).init_cache(2, 8))
    with pytest.raises(ValueError, match="cache is stacked"):
        model.decode(jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32),
                     with_layout(model, True).init_cache(2, 8))
