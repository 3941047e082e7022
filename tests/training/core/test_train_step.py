"""One train step (jit over a mesh; one device is a one-device mesh) is the same
update on 1 device, a (data=4, fsdp=2) mesh, and with gradient accumulation; its
pure pieces under pmap over 8 devices give the same loss and gradient (fp32; params rtol 1e-5, atol
1e-6; loss and grad norm rtol 1e-5). The RL loss (PPO-clip with TIS, task_mean)
is used: it exercises every part of the SFT path plus the ratio terms. The chunked
loss path (chunk_size) gives the same update."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ac2_jax.losses import aggregate_loss, loss_weights, policy_gradient_loss, token_logprobs
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.segments import pack_segments, pad_batch_rows
from ac2_jax.training import (
    OptimizerConfig,
    PolicyGradientLoss,
    SFTLoss,
    create_train_state,
    make_mesh,
    make_train_step,
)
from ac2_jax.training.core import StepCache, abstract_train_state
from ac2_jax.training.core.objectives import StepModel, model_logprobs
from ac2_jax.training.core.sharding import replicate, split_rows, unreplicate
from ac2_jax.training.core.train_step import CPU_MEMORY_SCHEDULER, forward, loss_and_grads
from ac2_jax.training.rl import rl_segment

CFG = DecoderConfig.tiny(vocab_size=48, num_layers=1)
# AdamW's first update is lr * g / (|g| + eps) ~ lr * sign(g): it turns fp32 reduction-order
# noise in near-zero (cancelling) gradient entries into O(lr) parameter differences. A
# larger eps keeps the update a smooth function of the gradient, so parameters can be
# compared at atol 1e-6; the moments (i.e. the gradients) are compared as well.
OPT = OptimizerConfig(learning_rate=1e-3, warmup_steps=2, weight_decay=0.1, eps=1e-3)
LOSS = PolicyGradientLoss(old_logprobs="sampler", clip_eps=0.2, tis_cap=2.0)
_BASE = []


def fresh():
    """(graphdef, state) of one fixed tiny model, as new device arrays (steps donate)."""
    if not _BASE:  # build the model once: eager init is slow on a shared CPU
        graphdef, state = create_train_state(Decoder(CFG, rngs=nnx.Rngs(0)), OPT)
        _BASE.extend([graphdef, jax.device_get(state)])
    return _BASE[0], jax.tree.map(jnp.asarray, _BASE[1])


@functools.partial(jax.jit, static_argnums=0)
def learner_logprobs(graphdef, state, batch):
    return token_logprobs(forward(graphdef, state.params, state.rest, batch), batch.targets)


@functools.partial(jax.jit, static_argnums=0)
def dense_behaviour_logprobs(graphdef, state, batch):
    """The single-device dense masked log-probs (`model_logprobs`, behaviour=True)."""
    model = StepModel(graphdef, state.params, state.rest)
    return model_logprobs(model, batch, behaviour=True, entropy=False, chunk_size=None)[0]


@pytest.fixture(scope="module")
def batch():
    """16 rows of 5 tasks; sampler log-probs near the learner's, so some ratios clip."""
    rng = np.random.default_rng(0)
    segs = []
    for t in range(5):
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.integers(4, 16))
            segs.append(rl_segment(rng.integers(0, 48, n), (rng.random(n) > 0.4).astype(np.float32),
                                np.zeros(n), task=f"t{t}", advantage=float(rng.normal())))
    b = pack_segments(segs, 16, rows_multiple=16)
    graphdef, state = fresh()
    noise = rng.normal(0, 0.3, b.shape).astype(np.float32)
    lp = np.asarray(learner_logprobs(graphdef, state, b)) + noise
    return b.replace(features={**b.features, "sampler_logprobs": lp})


def run_step(batch, loss=LOSS, **kw):
    graphdef, state = fresh()
    step = make_train_step(graphdef, loss, OPT, **kw)
    state, metrics = step(step.place(state), batch)
    return jax.device_get(state), jax.device_get(metrics)


@pytest.fixture(scope="module")
def reference(batch):
    return run_step(batch)


def assert_same_update(ref, got):
    (s_ref, m_ref), (s_got, m_got) = ref, got
    for k in ("loss", "grad_norm", "clip_frac", "kl_to_sampler", "entropy"):
        np.testing.assert_allclose(m_got[k], m_ref[k], rtol=1e-5, err_msg=k)
    for a, b in zip(jax.tree.leaves(s_ref.params), jax.tree.leaves(s_got.params)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(s_ref.opt_state), jax.tree.leaves(s_got.opt_state)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-8)
    assert int(s_got.step) == int(s_ref.step) == 1
    np.testing.assert_array_equal(s_got.rng, s_ref.rng)


def test_single_device_step_loss_and_metrics(batch, reference):
    state, metrics = reference
    graphdef, init = fresh()

    @jax.jit  # one compile, not one per eager op
    def reference_loss(init, batch):
        logp = learner_logprobs(graphdef, init, batch)
        f = batch.features
        per_token = policy_gradient_loss(logp, f["sampler_logprobs"], f["sampler_logprobs"],
                                         f["advantages"], batch.loss_mask, clip_eps=0.2)
        return aggregate_loss(per_token, batch, "task_mean")

    want = reference_loss(init, batch)
    np.testing.assert_allclose(metrics["loss"], float(want), rtol=1e-5)
    assert metrics["tokens"] == batch.num_real_tokens
    assert metrics["loss_tokens"] == int((batch.loss_mask > 0).sum())
    np.testing.assert_allclose(metrics["lr"], 0.5e-3, rtol=1e-6)  # warmup: step 0 -> lr / 2
    assert metrics["grad_norm"] > 0 and 0 < metrics["entropy"] <= np.log(48) + 1e-4
    assert 0 < metrics["clip_frac"] < 1 and metrics["kl_to_sampler"] > 0
    moved = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(state.params),
                                                  jax.tree.leaves(init.params))]
    assert min(moved) > 0


def test_mesh_data4_fsdp2_equals_single_device(batch, reference):
    mesh = make_mesh(data=4, fsdp=2)
    graphdef, state = fresh()
    step = make_train_step(graphdef, LOSS, OPT, mesh=mesh)
    placed = step.place(state)
    spec = P("fsdp", "tensor")  # the model's names for up_proj [hidden, intermediate]
    assert placed.params["layers"][0]["mlp"]["up_proj"][...].sharding.spec == spec
    mu = placed.opt_state[1][0].mu["layers"][0]["mlp"]["up_proj"][...]
    assert mu.sharding.spec == spec  # moments follow their param
    new, metrics = step(placed, batch)
    assert new.params["layers"][0]["mlp"]["up_proj"][...].sharding.spec == spec
    assert_same_update(reference, (jax.device_get(new), jax.device_get(metrics)))


def test_without_a_mesh_the_step_runs_on_a_one_device_mesh(batch):
    graphdef, state = fresh()
    step = make_train_step(graphdef, LOSS, OPT)
    assert step.mesh.devices.size == 1 and step.devices == jax.local_devices()[:1]
    leaf = step.place(state).params["layers"][0]["mlp"]["up_proj"][...]
    assert leaf.sharding.mesh == step.mesh and len(leaf.devices()) == 1


def test_pure_pieces_under_pmap_8_give_the_single_device_loss_and_gradient(batch, reference):
    """`loss_weights(axis_name=)` and `loss_and_grads` under jax.pmap over 8 devices,
    each on its 2 rows, psummed: the single-device step's loss and gradient norm
    (fp32, rtol 1e-5)."""
    graphdef, state = fresh()
    devices = jax.devices()[:8]

    def f(s, b):
        w = loss_weights(b, LOSS.mode, normalizer=LOSS.normalizer, axis_name="d")
        loss, _, grads, _ = loss_and_grads(graphdef, LOSS, s.params, s.rest, b, None, w)
        return jax.lax.psum((loss, grads), "d")

    out = jax.pmap(f, axis_name="d", devices=devices)(replicate(state, devices),
                                                      split_rows(batch, 8))
    loss, grads = unreplicate(out)
    np.testing.assert_allclose(loss, reference[1]["loss"], rtol=1e-5)
    np.testing.assert_allclose(optax.global_norm(grads), reference[1]["grad_norm"], rtol=1e-5)


def test_grad_accum_2_equals_full_batch(batch, reference):
    assert_same_update(reference, run_step(batch, grad_accum=2))


def _reversed_rows(b):
    return jax.tree_util.tree_map(lambda v: np.asarray(v)[::-1], b)  # every [rows, ...] leaf


@pytest.mark.parametrize("mode", ["one_device", "mesh"])
def test_grad_accum_skips_micro_batches_without_loss_tokens(batch, reference, mode):
    """A fixed geometry bigger than the data: the 16-row batch with 48 empty rows
    added, run as 4 micro-batches of 16. The step puts the rows with loss tokens in
    the first micro-batches (here the empty rows come first: the rows reversed),
    skips the 3 micro-batches left without a loss token (counted in
    `micro_batches_skipped`), and the update is the 16-row batch's (fp32, the
    tolerances of `assert_same_update`)."""
    padded = _reversed_rows(pad_batch_rows(batch, 64))
    assert not padded.loss_mask[:48].any()  # the empty rows lead
    kw = {"one_device": {}, "mesh": dict(mesh=make_mesh(data=4, fsdp=2))}[mode]
    got = run_step(padded, grad_accum=4, **kw)
    assert_same_update(reference, got)
    assert got[1]["micro_batches_skipped"] == 3 and got[1]["batch_rows"] == 64
    assert reference[1]["micro_batches_skipped"] == 0


def test_chunked_loss_step_equals_dense(batch, reference):
    """chunk_size=6 (rows of 16: 3 chunks of rows x 6 positions, the last one padded), on
    a (data=4, fsdp=2) mesh with grad_accum=2: the same update as the dense single device."""
    chunked = dataclasses.replace(LOSS, chunk_size=6)
    assert_same_update(reference, run_step(batch, chunked, mesh=make_mesh(data=4, fsdp=2),
                                           grad_accum=2))
    graphdef, state = fresh()
    step = make_train_step(graphdef, chunked, OPT)
    np.testing.assert_allclose(step.logprobs(state, batch),
                               learner_logprobs(graphdef, state, batch), rtol=1e-5, atol=1e-5)


def test_logprobs_on_a_mesh_match_the_model(batch):
    graphdef, state = fresh()
    step = make_train_step(graphdef, SFTLoss(), OPT, mesh=make_mesh(data=4, fsdp=2))
    got = step.logprobs(step.place(state), batch)
    np.testing.assert_allclose(got, learner_logprobs(graphdef, state, batch), rtol=1e-5,
                               atol=1e-5)


def test_equal_configurations_share_one_compiled_step(batch):
    """A StepCache (owned by its caller; no module state) gives equal configurations one
    TrainStep, which compiles once for states of the same shapes."""
    cache = StepCache()
    a = cache(fresh()[0], LOSS, OPT, grad_accum=2)
    b = cache(fresh()[0], LOSS, OPT, grad_accum=2)
    a(a.place(fresh()[1]), batch)
    b(b.place(fresh()[1]), batch)
    assert a is b and a._step._cache_size() == 1
    assert cache(fresh()[0], LOSS, OPT, grad_accum=1) is not a
    opts = {"xla_cpu_use_onednn": True}
    assert cache(fresh()[0], LOSS, OPT, grad_accum=2, xla_options=opts) is not a
    assert (cache(fresh()[0], LOSS, OPT, grad_accum=2, xla_options=opts)
            is cache(fresh()[0], LOSS, OPT, grad_accum=2, xla_options=dict(opts)))
    assert cache(fresh()[0], LOSS, OPT, grad_accum=2, xla_options={}) is not None
    # Without a cache every TrainStep compiles its own: no hidden global state.
    c = make_train_step(fresh()[0], LOSS, OPT, grad_accum=2)
    c(c.place(fresh()[1]), batch)
    assert c._step is not a._step


def test_step_donates_the_placed_state_and_place_copy_false_hands_it_over(batch):
    """The step's input state is donated (its buffers deleted after the step);
    place() copies, so the caller's arrays survive, while place(copy=False) reuses
    them: the step then owns the only copy (no second params + AdamW state)."""
    graphdef, state = fresh()
    step = make_train_step(graphdef, LOSS, OPT)
    placed = step.place(state)
    new, _ = step(placed, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves(placed))
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    owned = step.place(state, copy=False)
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves(owned)] == [
        x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)]
    step(owned, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves(state))  # handed over, not copied
    assert not any(x.is_deleted() for x in jax.tree.leaves(new))


def test_cpu_step_keeps_one_gradient_sized_set_of_temporaries():
    """XLA's accounting of the compiled step (abstract state: no weights): the whole
    state is donated (aliased to the output) and, with the memory-optimized CPU
    scheduler, the temporaries stay under 1.5x the params' bytes: the gradients
    plus one leaf's clipped gradient at a time. XLA:CPU's default scheduler clips
    every leaf before any AdamW update reads one (2.0x here; 4.78 GB against 2.71 GB
    for the Qwen3-0.6B step, docs/notes/2026-12-02-qwen3-06b-policy-on-2-cores.md). A params-dominated toy: 4,096-token
    vocabulary, 4 scanned layers, one row of 8 tokens."""
    cfg = DecoderConfig.tiny(vocab_size=4096, num_layers=4, hidden_size=64,
                             intermediate_size=192, scan_layers=True, remat="full")
    graphdef, abstract = abstract_train_state(lambda: Decoder(cfg), OPT)
    ids = np.arange(8) % 4096
    b = pack_segments([rl_segment(ids, np.ones(8), np.zeros(8), task="t", advantage=1.0)], 8)
    step = make_train_step(graphdef, LOSS, OPT)
    assert step.compiler_options() == CPU_MEMORY_SCHEDULER
    ma = step.lower(abstract, b).compile().memory_analysis()
    nbytes = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(t))  # noqa: E731
    assert ma.alias_size_in_bytes == nbytes(abstract)
    assert ma.temp_size_in_bytes <= 1.5 * nbytes(abstract.params), (
        ma.temp_size_in_bytes / nbytes(abstract.params))
    assert make_train_step(graphdef, LOSS, OPT, cpu_memory_scheduler=False
                           ).compiler_options() is None


def test_xla_options_reach_the_step_compile(batch, reference):
    """`xla_options` go into the step's compile on top of the CPU scheduler: a valid
    one computes the same update (fp32, rtol 1e-5), an unknown one fails naming
    itself."""
    graphdef, _ = fresh()
    opts = {"xla_cpu_prefer_vector_width": 512}
    step = make_train_step(graphdef, LOSS, OPT, xla_options=opts)
    assert step.compiler_options() == {**CPU_MEMORY_SCHEDULER, **opts}
    assert make_train_step(graphdef, LOSS, OPT, cpu_memory_scheduler=False,
                           xla_options=opts).compiler_options() == opts
    assert_same_update(reference, run_step(batch, xla_options=opts))
    with pytest.raises(Exception, match="xla_cpu_no_such_option"):
        run_step(batch, xla_options={"xla_cpu_no_such_option": True})


def test_bad_configuration_is_named(batch):
    graphdef, state = fresh()
    with pytest.raises(ValueError, match="grad_accum"):
        make_train_step(graphdef, LOSS, OPT, grad_accum=0)
    with pytest.raises(TypeError, match="OptimizerConfig"):
        make_train_step(graphdef, LOSS, "adam")
    step = make_train_step(graphdef, LOSS, OPT, mesh=make_mesh(data=4, fsdp=2), grad_accum=4)
    with pytest.raises(ValueError, match="rows_multiple=32"):
        step(step.place(state), batch)  # 16 rows cannot make 4 micro-batches over 8 shards


def test_benchmark_flop_count_matches_the_model():
    from benchmarks import bench_train_step as bench

    for name in bench.SIZES:
        c = bench.config_of(name)
        _, abstract = abstract_train_state(lambda: Decoder(c), OPT)  # noqa: B023
        leaves = jax.tree.leaves(abstract.params)
        matrices = sum(x.size for x in leaves if len(x.shape) == 2)
        assert bench.matmul_params(c) == matrices  # tied embeddings: the lm head, once


# --------------------------------------------------------------- grammar-constrained tokens


@pytest.fixture(scope="module")
def constrained_batch():
    """The `batch` fixture's kind of data with about half the trained tokens under a
    hand-made grammar mask (random, ~40% of the vocabulary, holding the token) and a
    table of 64 masks; sampler log-probs near the learner's masked ones."""
    from ac2_jax.segments import pack_mask_bits
    rng = np.random.default_rng(3)
    segs = []
    for t in range(5):
        for _ in range(int(rng.integers(1, 5))):
            n = int(rng.integers(4, 16))
            toks = rng.integers(0, 48, n)
            mask = (rng.random(n) > 0.4).astype(np.float32)
            s = rl_segment(toks, mask, np.zeros(n), task=f"t{t}", advantage=float(rng.normal()),
                           temperature=np.full(n, 0.8))
            on = np.flatnonzero((mask > 0) & (rng.random(n) < 0.5))
            masks = rng.random((len(on), 48)) < 0.4
            masks[np.arange(len(on)), toks[on]] = True
            ids = np.zeros(n, np.int32)
            ids[on] = np.arange(1, len(on) + 1)
            segs.append(s.with_constraints(ids, pack_mask_bits(masks)))
    b = pack_segments(segs, 16, rows_multiple=16, min_masks=32)
    assert b.constraint_masks.shape == (64, 2)  # 33..64 distinct masks
    graphdef, state = fresh()
    lp = np.asarray(dense_behaviour_logprobs(graphdef, state, b))
    noise = rng.normal(0, 0.3, b.shape).astype(np.float32)
    return b.replace(features={**b.features, "sampler_logprobs": lp + noise})


def _rows_reversed(b):
    """Every [rows, ...] leaf reversed; the (batch-level) mask table as it is."""
    table = b.constraint_masks
    return jax.tree_util.tree_map(lambda v: np.asarray(v)[::-1],
                                  b.replace(constraint_masks=None)).replace(constraint_masks=table)


def test_constrained_batch_same_update_on_a_mesh_with_accumulation_and_chunks(constrained_batch):
    """The mask table is not row-aligned: it goes whole to every device and micro-batch.
    Padded to 64 rows (as many as the table has masks: a row permutation would scramble a
    table taken for rows), rows reversed, on a (data=4, fsdp=2) mesh, grad_accum=4 (so
    fill_micro_batches reorders rows), chunked: the single-device dense update."""
    ref = run_step(constrained_batch)
    padded = _rows_reversed(pad_batch_rows(constrained_batch, 64))
    assert padded.shape[0] == padded.constraint_masks.shape[0] == 64
    assert_same_update(ref, run_step(padded, dataclasses.replace(LOSS, chunk_size=6),
                                     grad_accum=4, mesh=make_mesh(data=4, fsdp=2)))


def test_logprobs_of_a_constrained_batch_on_a_mesh(constrained_batch):
    """TrainStep.logprobs (PPO old log-probs) on a mesh, chunked: the masked log-probs of
    the single-device dense path (fp32, 1e-5); the table is placed replicated."""
    from ac2_jax.training.core.sharding import shard_batch
    graphdef, state = fresh()
    want = dense_behaviour_logprobs(graphdef, state, constrained_batch)  # as in the fixture
    step = make_train_step(graphdef, dataclasses.replace(LOSS, chunk_size=6), OPT,
                           mesh=make_mesh(data=4, fsdp=2))
    got = step.logprobs(step.place(state), constrained_batch)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    placed = shard_batch(constrained_batch, make_mesh(data=8))
    assert placed.constraint_masks.sharding.is_fully_replicated
    assert not placed.tokens.sharding.is_fully_replicated
