"""The RL recipe end to end on a toy env: trains, publishes where told, resumes."""

import dataclasses
import json
import os

from ac2_jax.config_cli import load_config
from ac2_jax.recipes import RLRecipeConfig, load_model, rl
from ac2_jax.trace import TraceStore
from tests.recipe_helpers import ParityEnv

OVERRIDES = ["rl.steps=1", "rl.tasks_per_step=2", "rl.attempts_per_task=4", "rl.batch.rows=2",
             "rl.batch.seq_len=128", "rl.concurrency=8", "rollout.max_tokens=8",
             "rollout.max_steps=1", "sampler.warmup=false", "log.progress=false"]


def test_rl_trains_publishes_where_told_and_resumes(tmp_path):
    model = load_model("tiny", str(tmp_path / "build"))
    publish = tmp_path / "elsewhere" / "published"  # outside the workdir's tree
    cfg = load_config(RLRecipeConfig, None, [*OVERRIDES, f"paths.workdir={tmp_path / 'run'}",
                                             f"paths.publish={publish}"])
    report = rl(model, ParityEnv(), cfg).report
    assert report["steps"] == 1 and report["published"] == str(publish)
    assert sorted(os.listdir(publish)) == ["1"]  # the weights after update 1
    assert not os.path.exists(tmp_path / "run" / "published")
    metrics = [json.loads(x) for x in open(tmp_path / "run" / "metrics" / "metrics.jsonl")]
    assert metrics[0]["train/skipped_update"] == 0.0 and metrics[0]["train/grad_norm"] > 0
    assert os.path.isdir(tmp_path / "run" / "metrics" / "tensorboard")
    saved = json.load(open(tmp_path / "run" / "report" / "config.json"))
    assert saved["rl"]["steps"] == 1 and saved["paths"]["publish"] == str(publish)

    # Resume: the same workdir with two steps trains only the second.
    cfg2 = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, steps=2))
    report = rl(model, ParityEnv(), cfg2).report
    assert report["steps"] == 1
    traces = TraceStore(str(tmp_path / "run" / "traces" / "rollouts.jsonl")).read()
    keys = [(t.metadata["rl_step"], t.task_id, t.metadata["attempt"]) for t in traces]
    assert len(keys) == len(set(keys)) == 2 * 2 * 4  # two steps, no rollout run twice
    assert sorted(os.listdir(publish)) == ["1", "2"]


def test_requests_without_max_tokens_stop_at_the_configured_default(tmp_path):
    # Finding: the tiny model answered its first request after 21.7 s when no max_tokens
    # was given: it decoded to the end of the context. The endpoint's default is now
    # rollout.max_tokens.
    import asyncio

    import openai

    from ac2_jax.recipes.common import serve_policy
    from ac2_jax.recipes.config import RolloutConfig, SamplerConfig

    model, tokenizer = load_model("tiny", str(tmp_path / "build"))

    async def ask():
        async with serve_policy(
            model, tokenizer, publish_dir=str(tmp_path / "pub"), traces_dir=str(tmp_path / "t"),
            sampler=SamplerConfig(warmup=False), rollout=RolloutConfig(max_tokens=5),
            max_batch=2,
        ) as (_, lifecycle):
            rollout = await lifecycle.create("t0")
            client = openai.AsyncOpenAI(base_url=rollout["base_url"], api_key=rollout["api_key"])
            out = await client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}], temperature=1.0)
            await client.close()
            return out

    out = asyncio.run(ask())
    assert out.usage.completion_tokens <= 5


def test_rl_with_lora_trains_and_publishes_the_adapters_only(tmp_path):
    """`lora.rank=4`: the optimizer holds the adapters only (the base is frozen:
    unchanged after the step), each publish carries the adapters alone, and the
    export is the merged HF checkpoint plus the adapter in PEFT's format."""
    import jax
    import numpy as np
    from flax import nnx

    from ac2_jax.models.hf_io import load_hf_checkpoint
    from ac2_jax.models.peft_io import read_peft_config

    model, tok = load_model("tiny", str(tmp_path / "build"))
    base = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    cfg = load_config(RLRecipeConfig, None, [*OVERRIDES, f"paths.workdir={tmp_path / 'run'}",
                                             "lora.rank=4", "lora.alpha=8",
                                             "rl.optimizer.learning_rate=1e-2"])
    result = rl((model, tok), ParityEnv(), cfg)
    final = result.model
    assert final.config.lora.rank == 4
    for key, var in nnx.to_flat_state(nnx.state(final, nnx.Param)):
        if isinstance(var, nnx.LoRAParam):
            continue
        np.testing.assert_array_equal(np.asarray(var[...]), base[key])  # frozen
    b = [v for k, v in nnx.to_flat_state(nnx.state(final, nnx.LoRAParam)) if k[-1] == "b"]
    assert any(np.abs(np.asarray(x[...])).max() > 0 for x in b)  # the adapters trained
    step = tmp_path / "run" / "published" / "1"
    assert {"lora", "params"} <= set(os.listdir(step))
    report = result.report
    assert read_peft_config(report["adapter"]).rank == 4
    merged, _ = load_hf_checkpoint(report["hf_export"])
    t = jax.numpy.asarray([[5, 9, 13, 2]])
    args = (t, jax.numpy.arange(4)[None], jax.numpy.ones_like(t))
    np.testing.assert_allclose(merged(*args), final(*args), atol=1e-4)
