"""Routing replay end to end: JaxSampler on a MoE model -> trace -> segments -> batch -> loss.

The sampler's model has its router perturbed (std 1e-3 against weights of std
0.1), so some of its top-k choices differ from the learner's: the numerics gap
routing replay exists for. The JaxSampler records the experts of every token
it runs (`SampleResult.routed_experts`), the completion stores them as the
endpoint does, `segments_from_trace` and the flat packer carry them into
`PackedBatch.routing`, and the train step's log-probs (`model_logprobs`)
replay them: the learner's log-probs of the sampled tokens then match the
sampler's recorded ones far more closely than when it routes by itself
(`rl.moe.routing="recompute"`, no routing in the batch).
"""

import asyncio
import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from ac2_jax.models.family import build_model
from ac2_jax.models.moe import MoEDecoderConfig
from ac2_jax.sampling import JaxSampler, SamplingParams
from ac2_jax.sampling.base import SampleResult, truncate_at_stop
from ac2_jax.segments import SAMPLER_LOGPROBS, pack_segments, segments_from_trace
from ac2_jax.trace import Completion, Episode, Trace, decode_routing, encode_routing
from ac2_jax.training.core.objectives import StepModel, model_logprobs

CONFIG = MoEDecoderConfig.tiny(
    num_layers=3, mlp_only_layers=(0,), norm_topk_prob=True, initializer_range=0.1,
    scan_layers=False, remat="none",
)  # fmt: skip
PROMPTS = [list(range(3, 14)), list(range(40, 47)), list(range(3, 12)) + [90, 91]]


@pytest.fixture(scope="module")
def sampled():
    learner = build_model(CONFIG, nnx.Rngs(3))
    graphdef, params, rest = nnx.split(learner, nnx.Param, ...)
    noisy = nnx.to_pure_dict(params)
    for i in CONFIG.moe_layers:
        gate = noisy["layers"][i]["mlp"]["gate"]
        noisy["layers"][i]["mlp"]["gate"] = gate + 1e-3 * jax.random.normal(
            jax.random.key(i), gate.shape
        )
    sampler_params = nnx.clone(params)
    nnx.replace_by_pure_dict(sampler_params, noisy)
    sampler = JaxSampler(
        nnx.merge(graphdef, sampler_params, rest), max_context=64, max_batch=4, min_batch=4,
        min_cache_len=64, steps_per_sync=4, prefill_chunk=8, seed=0, max_top_logprobs=0,
    )  # fmt: skip
    try:
        params_ = SamplingParams(temperature=1.0, max_tokens=24, seed=1)

        async def go():  # the third prompt shares the first's prefix (reused keys)
            first = await asyncio.gather(*(sampler.generate(p, params_) for p in PROMPTS[:2]))
            return [*first, await sampler.generate(PROMPTS[2], params_)]

        results = asyncio.run(go())
    finally:
        sampler.close()
    return StepModel(graphdef, params, rest), results


def _trace(results) -> Trace:
    episodes = []
    for p, r in zip(PROMPTS, results, strict=True):
        c = Completion(prompt_ids=p, output_ids=list(r.output_ids),
                       output_logprobs=list(r.output_logprobs), temperature=1.0,
                       routed_experts=r.routed_experts)  # as the endpoint records it
        c = Completion.from_dict(c.to_dict())  # through the store's JSON form
        episodes.append(Episode(agent="main", token_ids=p + list(r.output_ids),
                                loss_mask=[0] * len(p) + [1] * len(r.output_ids),
                                sampler_logprobs=[0.0] * len(p) + list(r.output_logprobs),
                                completions=[c]))
    return Trace(task_id="t", episodes=episodes, reward=1.0, status="finished")


def test_the_sampler_records_every_token_it_ran(sampled):
    _, results = sampled
    for i, (p, r) in enumerate(zip(PROMPTS, results, strict=True)):
        ids = decode_routing(r.routed_experts)
        assert ids.shape == (len(p) + len(r.output_ids), 2, 2)
        recorded = np.all(ids >= 0, axis=(1, 2))
        assert not recorded[-1]  # the last sampled token is never fed back
        ran = np.arange(r.cached_tokens, len(ids) - 1)  # a reused prefix was not run
        assert recorded[ran].all() and not recorded[: r.cached_tokens].any()
        assert (r.cached_tokens > 0) == (i == 2)


def test_replayed_routing_makes_learner_logprobs_match_the_sampler(sampled):
    model, results = sampled
    segments = segments_from_trace(_trace(results))
    assert all(s.routing is not None for s in segments)
    batch = pack_segments(segments, 64)
    assert batch.routing.shape == (*batch.shape, 2, 2)
    mask = batch.loss_mask > 0
    want = batch.features[SAMPLER_LOGPROBS]

    @functools.partial(jax.jit, static_argnames="chunk")  # one compile each, not one per op
    def logprobs(b, chunk=None):
        return model_logprobs(model, b, behaviour=True, entropy=False, chunk_size=chunk)[0]

    def gap(b):
        return np.abs(np.asarray(logprobs(b)) - want)[mask]

    replay, recompute = gap(batch), gap(dataclasses.replace(batch, routing=None))
    chunked = np.asarray(logprobs(batch, chunk=16))  # the chunked path replays too
    assert np.abs(chunked - want)[mask].max() == pytest.approx(replay.max(), abs=1e-6)
    assert replay.max() < 5e-3 and recompute.max() > 10 * replay.max()


def test_stop_cut_keeps_the_routing_of_the_kept_tokens():
    ids = np.arange(5 * 2 * 2).reshape(5, 2, 2) % 8
    r = SampleResult([7, 8, 9], [0.0] * 3, "length", 0, routed_experts=encode_routing(ids))
    cut, hit = truncate_at_stop(r, ["b"], lambda t: "".join("ab c"[x - 7] for x in t))
    assert hit == "b" and cut.output_ids == [7, 8]
    assert (decode_routing(cut.routed_experts) == ids[:4]).all()


def test_rl_batches_carry_routing_unless_recompute(sampled):
    """build_batch: the batch replays the recorded routing (counted), every share of a
    multi-process batch carries it alike; rl.moe.routing="recompute" packs none; a
    prefix tree cannot merge two samplers' routings and says so."""
    from ac2_jax.training.rl import BatchConfig, MoEConfig, RLConfig, build_batch

    _, results = sampled
    trace = _trace(results)
    config = BatchConfig(seq_len=64, rows=4)
    batch, stats, _ = build_batch([trace], 0, config)
    recorded = sum(int(np.all(decode_routing(r.routed_experts) >= 0, axis=(1, 2)).sum())
                   for r in results)
    assert batch.routing is not None and stats.replayed_routing_tokens == recorded
    share, _, _ = build_batch([trace], 0, config, process_index=3, process_count=4)
    assert share.routing.shape == (*share.shape, 2, 2)  # a share whose segments record none
    plain, stats, _ = build_batch([trace], 0, config, moe_routing="recompute")
    assert plain.routing is None and stats.replayed_routing_tokens == 0
    with pytest.raises(ValueError, match="pack them flat"):
        build_batch([trace], 0, dataclasses.replace(config, layout="tree"))
    with pytest.raises(ValueError, match="rl.moe.routing must be one of"):
        MoEConfig(routing="both")
    assert RLConfig().moe.routing == "replay"


@pytest.mark.alarms_expected
def test_routing_alarm_quiet_for_the_sampler_router_fires_on_a_perturbed_one(sampled, tmp_path):
    """Issue 65's routing alarm: the fraction of tokens whose learner top k differs from
    the recorded routing. The fixture's sampler router differs from the learner's by
    1e-3 (a numerics-sized gap): a few tokens flip, below the default 10%. A learner
    router moved by 0.5 routes most tokens elsewhere: with replay off
    (rl.moe.routing="recompute") the RLTrainer measures it on its batch (which then
    replays nothing) and fires, naming the config key."""
    from ac2_jax.training import OptimizerConfig, PolicyGradientLoss
    from ac2_jax.training.rl import BatchConfig, MoEConfig, ReplayCollector, RLConfig, RLTrainer
    from ac2_jax.training.rl.alarms import AlarmConfig, AlarmsConfig, routing_mismatch

    model, results = sampled
    batch = pack_segments(segments_from_trace(_trace(results)), 64)


    @jax.jit  # one compile, not one per op
    def routed(params, b):
        module = nnx.merge(model.graphdef, params, model.rest)
        return module.forward_with_router(b.tokens, b.positions, b.segment_ids)[1].experts

    experts = routed(model.params, batch)
    healthy = routing_mismatch(np.asarray(experts), batch.routing, batch.segment_ids > 0)
    assert healthy["routing/tokens"] > 40 and healthy["routing/mismatch"] < 0.1

    moved = nnx.to_pure_dict(model.params)
    for i in CONFIG.moe_layers:
        gate = moved["layers"][i]["mlp"]["gate"]
        moved["layers"][i]["mlp"]["gate"] = gate + 0.5 * jax.random.normal(
            jax.random.key(10 + i), gate.shape)
    params = nnx.clone(model.params)
    nnx.replace_by_pure_dict(params, moved)
    traces = []
    for a, reward in enumerate((0.0, 1.0)):
        t = _trace(results)
        t.attempt_id, t.group_id, t.reward, t.metadata = str(a), "g", reward, {"rl_step": 0}
        traces.append(t)
    config = RLConfig(steps=1, tasks_per_step=1, attempts_per_task=2,
                      moe=MoEConfig(routing="recompute"), batch=BatchConfig(seq_len=64, rows=4),
                      loss=PolicyGradientLoss(), optimizer=OptimizerConfig(learning_rate=1e-3))
    trainer = RLTrainer(nnx.merge(model.graphdef, params, model.rest), ReplayCollector(traces),
                        config, str(tmp_path),  # drift off: one learner forward fewer
                        alarms=AlarmsConfig(drift=AlarmConfig(threshold=0.1, action="off")))
    try:
        (m,) = asyncio.run(trainer.run())
    finally:
        trainer.close()
    assert m["routing/mismatch"] > 0.5 and m["replayed_routing_tokens"] == 0
    ((name, line),) = [f for f in trainer.alarms.fired if f[0] == "routing"]
    assert line.startswith("ALARM routing (warn): MoE routing mismatch: the learner routes")
    assert "--config.alarms.routing.action=off" in line
