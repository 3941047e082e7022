"""RLTrainer (training/rl/trainer.py) on grammar-constrained completions recorded by the
real endpoint: tool_choice="required" through the official openai client, a JaxSampler
over a tiny random model, the trace store; then the learner (same weights) re-scores the
recorded tokens. With the masks replayed (RLTrainer(tokenizer=)) the on-policy PPO ratio
exp(logp - sampler_logp) is 1 (|r - 1| < 1e-5, fp32) at every trained position, dense
and chunked, and the update sees clip_frac 0 and kl_to_sampler ~0; without them (the
unmasked re-score) the constrained positions' ratios are far from 1.

Its own file (not test_rl_trainer.py): one endpoint and one learner, ~20 s."""

import asyncio

import jax
import numpy as np
import openai
import pytest
from flax import nnx

from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.orchestration import LifecycleClient
from ac2_jax.segments import CONSTRAINT_ID, SAMPLER_LOGPROBS
from ac2_jax.trace import TraceStore
from ac2_jax.training import OptimizerConfig, PolicyGradientLoss
from ac2_jax.training.core import StepModel, make_mesh, model_logprobs
from ac2_jax.training.rl import (
    BatchConfig,
    ReplayCollector,
    RLConfig,
    RLTrainer,
    batch_segments,
    pack_rl_batch,
)
from tests.support.serving_helpers import served_random_model

ADMIN = "sk-admin-constrained"
CTX = 512
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
       "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                      "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}}


async def _rollouts(url: str) -> None:
    """Two attempts at one task (rewards 1 and 0): a tool call forced by tool_choice
    "required" (temperature 0.8, top_k 40, top_p 0.95: the mask comes first), the tool's
    answer, then a free reply (tool_choice "none")."""
    lc = LifecycleClient(url, ADMIN)
    try:
        for i, reward in enumerate([1.0, 0.0]):
            r = await lc.create("sum", group_id="g:sum")
            async with openai.AsyncOpenAI(base_url=r["base_url"], api_key=r["api_key"]) as client:
                msgs = [{"role": "user", "content": "What is 3 + 4?"}]
                resp = await client.chat.completions.create(
                    model="tiny", messages=msgs, tools=[ADD], tool_choice="required",
                    parallel_tool_calls=False, temperature=0.8, top_p=0.95, max_tokens=60,
                    seed=i, extra_body={"top_k": 40})
                msg = resp.choices[0].message
                assert msg.tool_calls and msg.tool_calls[0].function.name == "add"
                msgs.append(msg.model_dump(exclude_none=True))
                msgs.append({"role": "tool", "tool_call_id": msg.tool_calls[0].id,
                             "content": "7"})
                await client.chat.completions.create(
                    model="tiny", messages=msgs, tools=[ADD], tool_choice="none",
                    temperature=1.0, max_tokens=8, seed=10 + i)
            await lc.finish(r["rollout_id"], reward=reward)
    finally:
        await lc.aclose()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(traces, tokenizer, the sampler's model config) of the two recorded attempts."""
    tmp = tmp_path_factory.mktemp("constrained")
    store = TraceStore(str(tmp / "rollouts.jsonl"))
    with served_random_model(tmp, ADMIN, trace_store=store, max_context=CTX,
                             max_batch=2) as (url, tok):
        asyncio.run(_rollouts(url))
    # served_random_model's Decoder (seed 0): the learner starts from the sampler's weights.
    cfg = DecoderConfig.tiny(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                             num_heads=2, num_kv_heads=1, head_dim=16,
                             max_position_embeddings=CTX)
    return store.load(), tok, cfg


@pytest.mark.full  # the RL trainer end to end over recorded endpoint traffic (~13 s of compile)
def test_recorded_tool_calls_train_on_policy_under_their_masks(recorded, tmp_path):
    traces, tok, cfg = recorded
    assert len(traces) == 2
    for t in traces:
        (ep,) = t.episodes
        assert [c.constraint is not None for c in ep.completions] == [True, False]
    config = RLConfig(steps=1, tasks_per_step=1, attempts_per_task=2,
                      batch=BatchConfig(seq_len=CTX, rows=2),
                      loss=PolicyGradientLoss(old_logprobs="sampler", chunk_size=128),
                      optimizer=OptimizerConfig(learning_rate=1e-3))
    trainer = RLTrainer(Decoder(cfg, rngs=nnx.Rngs(0)), ReplayCollector(traces), config,
                        str(tmp_path / "run"), tokenizer=tok, mesh=make_mesh(data=2))
    try:
        segments, stats, _ = batch_segments(traces, 0, trainer._batch_config, tokenizer=tok,
                                            vocab_size=cfg.vocab_size)
        batch = pack_rl_batch(segments, stats.row_len, trainer._batch_config)
        unmasked = batch.replace(constraint_masks=None, features={
            k: v for k, v in batch.features.items() if k != CONSTRAINT_ID})
        sampler = batch.features[SAMPLER_LOGPROBS]
        trained = batch.loss_mask > 0
        on = trained & (batch.features[CONSTRAINT_ID] > 0)
        assert on.sum() >= 20 and (trained & ~on).sum() >= 8
        state = jax.device_get(trainer.state)
        model = StepModel(trainer.graphdef, state.params, state.rest)
        ratios = {
            "chunked, masked": trainer.step_fn.logprobs(trainer.state, batch),
            "dense, masked": jax.jit(lambda b: model_logprobs(  # one compile, not one per op
                model, b, behaviour=True, entropy=False, chunk_size=None)[0])(batch),
            "chunked, unmasked": trainer.step_fn.logprobs(trainer.state, unmasked),
        }
        ratios = {k: np.exp(np.asarray(v) - sampler) for k, v in ratios.items()}
        for name, r in ratios.items():
            print(f"{name}: max |r - 1| over {int(trained.sum())} trained positions "
                  f"{np.abs(r[trained] - 1).max():.2e}, over the {int(on.sum())} constrained "
                  f"{np.abs(r[on] - 1).max():.2e} (median {np.median(np.abs(r[on] - 1)):.2e})")
        for name in ("chunked, masked", "dense, masked"):
            assert np.abs(ratios[name][trained] - 1).max() < 1e-5, name
        r0 = ratios["chunked, unmasked"]
        assert np.abs(r0[trained & ~on] - 1).max() < 1e-5  # free tokens: as before
        assert np.median(np.abs(r0[on] - 1)) > 0.5  # today's re-score: far from on-policy
        metrics = trainer.update(traces)
        print({k: metrics[k] for k in ("clip_frac", "kl_to_sampler", "grad_norm")})
        assert metrics["skipped_update"] == 0 and metrics["grad_norm"] > 0
        assert metrics["clip_frac"] == 0 and abs(metrics["kl_to_sampler"]) < 1e-6
    finally:
        trainer.close()


def test_without_the_tokenizer_constrained_traces_are_refused(recorded, tmp_path):
    traces, _, cfg = recorded
    config = RLConfig(steps=1, tasks_per_step=1, attempts_per_task=2,
                      batch=BatchConfig(seq_len=CTX, rows=2))
    trainer = RLTrainer(Decoder(cfg, rngs=nnx.Rngs(0)), ReplayCollector(traces), config,
                        str(tmp_path / "run"))
    try:
        with pytest.raises(ValueError, match="tokenizer="):
            trainer.update(traces)
    finally:
        trainer.close()
