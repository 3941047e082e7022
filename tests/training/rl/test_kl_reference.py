"""KL to the reference policy and the entropy bonus (issue 64): with the policy equal to the
reference the KL term is 0 and so is its gradient (k3); the reference is scored chunked
like the policy (1e-5); the bonus is -c H with H's gradient, chunked = dense; the LoRA
reference (adapters zeroed) equals a second frozen copy of the base (1e-5); a KL without a
reference is an error; the RLTrainer passes the launch weights to its steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ac2_jax.losses import loss_weights, token_entropy
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.models.io.peft_io import merge_lora
from ac2_jax.models.lora import LoRAConfig
from ac2_jax.training import OptimizerConfig
from ac2_jax.training.core.objectives import (
    StepModel,
    apply_loss,
    behaviour_logprobs,
    reference_logprobs,
)
from ac2_jax.training.rl import GRPOLoss
from ac2_jax.training.rl.trainer import launch_reference
from tests.training.rl.test_objective_kinds import attempts


def tiny(lora=None):
    return Decoder(DecoderConfig.tiny(vocab_size=30, num_layers=1, lora=lora), rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def setup():
    batch, _ = attempts(0)
    batch = batch.replace(features={k: v for k, v in batch.features.items()
                                    if k in ("advantages", "sampler_logprobs")})
    graphdef, params, rest = nnx.split(tiny(), nnx.Param, ...)
    return batch, graphdef, params, rest


def test_kl_is_zero_with_zero_gradient_at_the_reference(setup):
    batch, graphdef, params, rest = setup
    w = loss_weights(batch, "task_mean")
    # (k1: its value is -log q = 0 here, its gradient grad log pi per token, zero only in
    # expectation; k2's gradient -log q is 0 at q = 1: test_objective_kinds checks all three
    # against numpy at random q)
    losses = [GRPOLoss(), GRPOLoss(kl_coef=0.5, kl_estimator="k3")]
    losses += [GRPOLoss(kl_coef=0.5, chunk_size=7)]  # the chunked reference
    # the entropy bonus: l - c H per token, dense and chunked (gradient through H)
    losses += [GRPOLoss(entropy_coef=0.1), GRPOLoss(entropy_coef=0.1, chunk_size=7)]

    @jax.jit
    def run(p, ref):
        out = []
        for fn in losses:
            def f(p):
                per_token, sums = apply_loss(fn, StepModel(graphdef, p, rest, ref), batch, None)
                return (w * per_token).sum(), sums
            (v, sums), g = jax.value_and_grad(f, has_aux=True)(p)
            out.append((v, sums.get("kl_to_reference", 0.0), g))
        h = (w * token_entropy(StepModel(graphdef, p, rest).logits(batch))).sum()
        return out, h

    same, h = run(params, params)
    v0, _, g0 = same[0]
    np.testing.assert_allclose(float(same[3][0]), float(v0) - 0.1 * float(h), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(same[4][2]), jax.tree.leaves(same[3][2])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert any(np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-4
               for a, b in zip(jax.tree.leaves(same[3][2]), jax.tree.leaves(g0)))
    for k, (v, kl, g) in zip(("k3", "k3 chunked"), same[1:3]):
        np.testing.assert_allclose(float(v), float(v0), atol=1e-6, err_msg=k)
        assert float(kl) == 0.0, k
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, err_msg=k)
    # a reference elsewhere: the term is there, and the chunked reference equals the dense one
    moved = jax.tree.map(lambda x: x + 0.05 * jnp.sin(jnp.arange(x.size).reshape(x.shape)), params)
    far, _ = run(params, moved)
    assert float(far[1][1]) > 1e-4 and abs(float(far[1][0]) - float(v0)) > 1e-5
    np.testing.assert_allclose(float(far[2][0]), float(far[1][0]), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(far[2][2]), jax.tree.leaves(far[1][2])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_a_kl_without_reference_is_an_error(setup):
    batch, graphdef, params, rest = setup
    with pytest.raises(ValueError, match="reference"):
        apply_loss(GRPOLoss(kl_coef=0.1), StepModel(graphdef, params, rest), batch, None)


def test_lora_reference_is_the_base_without_a_copy(setup):
    """Adapters zeroed (`launch_reference`) score as a second frozen copy of the base
    model (merge_lora of the fresh adapters, B = 0, is that copy)."""
    batch = setup[0]
    model = tiny(LoRAConfig(rank=2, alpha=4.0))
    base = merge_lora(model)  # the second copy: fresh adapters add 0
    graphdef, params, rest = nnx.split(model, nnx.LoRAParam, ...)
    params = jax.tree.map(lambda x: x + 0.3 * jnp.cos(jnp.arange(x.size).reshape(x.shape)), params)
    ref = launch_reference(model, params)
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(ref))
    base_gd, base_state = nnx.split(base)

    @jax.jit
    def run(params, ref, base_state):
        step_model = StepModel(graphdef, params, rest, ref)
        base_model = nnx.merge(base_gd, base_state)
        want = behaviour_logprobs(base_model(batch.tokens, batch.positions, batch.segment_ids),
                                  batch)
        got = [reference_logprobs(step_model, batch, chunk) for chunk in (None, 7)]
        return want, got, behaviour_logprobs(step_model.logits(batch), batch)

    want, got, policy = run(params, ref, base_state)
    m = np.asarray(batch.loss_mask) > 0
    for g in got:
        np.testing.assert_allclose(np.asarray(g)[m], np.asarray(want)[m], atol=1e-5)
    assert np.abs(np.asarray(policy)[m] - np.asarray(want)[m]).max() > 1e-3  # adapters act


# Its traces' log-probs are not these weights' (made up, or relabelled as sampled by
# each step's policy): the drift alarm fires by design (issue 65).
@pytest.mark.alarms_expected("drift")
def test_the_rl_trainer_trains_against_the_launch_weights(tmp_path):
    """RLTrainer: rl.loss.kl_coef > 0 makes it hold the launch weights (a copy) and pass
    them to every step; step 0 is at the reference (KL 0), step 1 has moved away; a LoRA
    model's reference is its adapters zeroed; without a KL there is none."""
    import asyncio
    import dataclasses

    from ac2_jax.training import BatchConfig, RLConfig
    from ac2_jax.training.rl import ReplayCollector, RLTrainer
    from tests.support.rl_traces import rl_trace

    traces = [rl_trace(task, a, float(a % 2), n_out=4) for task in ("a", "b") for a in range(4)]
    for step in (0, 1):  # the same attempts replayed at steps 0 and 1
        traces += [dataclasses.replace(t, attempt_id=f"{t.attempt_id}-{step}",
                                       metadata={"rl_step": step}) for t in traces[:8]]
    traces = traces[8:]
    config = RLConfig(steps=2, tasks_per_step=2, attempts_per_task=4, concurrency=8,
                      batch=BatchConfig(seq_len=32, rows=4),
                      loss=GRPOLoss(kl_coef=0.1, old_logprobs="detached"),
                      optimizer=OptimizerConfig(learning_rate=1e-2))
    model = tiny()
    launch = jax.tree.map(np.asarray, nnx.state(model, nnx.Param))
    trainer = RLTrainer(model, ReplayCollector(traces), config, str(tmp_path / "full"))
    m0, m1 = asyncio.run(trainer.run())
    for a, b in zip(jax.tree.leaves(trainer.reference), jax.tree.leaves(launch)):
        np.testing.assert_array_equal(np.asarray(a), b)
    moved = jax.tree.leaves(trainer.trainer.host_state().params)
    assert any(np.any(np.asarray(a) != b) for a, b in zip(moved, jax.tree.leaves(launch)))
    trainer.close()
    assert m0["kl_to_reference"] == 0.0 and m1["kl_to_reference"] > 0.0
    assert m0["skipped_update"] == m1["skipped_update"] == 0.0
    lora = RLTrainer(tiny(LoRAConfig(rank=2, alpha=4.0)), ReplayCollector([]), config,
                     str(tmp_path / "lora"))
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(lora.reference))
    lora.close()
    plain = RLTrainer(tiny(), ReplayCollector([]), dataclasses.replace(config, loss=GRPOLoss()),
                      str(tmp_path / "plain"))
    assert plain.reference is None
    plain.close()


def test_what_each_kl_estimator_minimises_as_a_loss():
    """As a loss (x ~ pi held fixed, the gradient through log pi(x)), the expected gradient
    E_x~pi[grad k(x)] is, exactly on a 6-way categorical: k1 0, k2 grad KL(pi || pi_ref),
    k3 grad KL(pi_ref || pi) (the forward KL; Tang & Munos 2025, "On a few pitfalls in KL
    divergence gradient estimation for RL"). fp32, atol 1e-6."""
    from ac2_jax.losses import kl_estimate

    theta = jnp.array([0.3, -1.2, 0.8, 0.0, 2.1, -0.4])
    ref = jax.nn.log_softmax(jnp.array([1.0, 0.2, -0.5, 0.4, 0.9, -1.1]))

    def expected(kind):
        def f(t):
            logp = jax.nn.log_softmax(t)
            return (jax.lax.stop_gradient(jnp.exp(logp)) * kl_estimate(logp, ref, kind)).sum()
        return jax.grad(f)(theta)

    def kl(t, reverse):
        logp = jax.nn.log_softmax(t)
        p, q = (jnp.exp(logp), logp - ref) if reverse else (jnp.exp(ref), ref - logp)
        return (p * q).sum()

    np.testing.assert_allclose(expected("k1"), 0.0, atol=1e-6)
    np.testing.assert_allclose(expected("k2"), jax.grad(kl)(theta, True), atol=1e-6)
    np.testing.assert_allclose(expected("k3"), jax.grad(kl)(theta, False), atol=1e-6)
