"""The RL recipe end to end on a toy env: trains, publishes where told, resumes."""

import dataclasses
import functools
import importlib
import io
import json
import os

import pytest

from ac2_jax.config_cli import load_config
from ac2_jax.recipes import RLRecipeConfig, load_model, rl
from ac2_jax.trace import TraceStore
from tests.support.recipe_helpers import ParityEnv

OVERRIDES = ["rl.steps=1", "rl.tasks_per_step=2", "rl.attempts_per_task=4", "rl.batch.rows=2",
             "rl.batch.seq_len=128", "rl.concurrency=8", "rollout.max_tokens=8",
             "rollout.max_steps=1", "sampler.warmup=false", "log.progress=false",
             "log.report_files=false"]  # on where a test checks them


def _count_reloads(monkeypatch) -> list:
    """The steps the embedded sampler reloads from the publish folder (JaxSampler.
    load_weights, still run)."""
    from ac2_jax.sampling.engine.jax_sampler import JaxSampler

    loads, real = [], JaxSampler.load_weights

    def load_weights(self, step=None):
        loads.append(step)
        return real(self, step)

    monkeypatch.setattr(JaxSampler, "load_weights", load_weights)
    return loads


def test_rl_trains_publishes_where_told_and_resumes(tmp_path, monkeypatch):
    # sampler.hand_off="memory" (the default): the sampler takes each update in memory and
    # never reloads it from the folder (review of issue 66: the recipe also passed
    # on_publish=load_weights, a second load of every update from disk).
    reloads = _count_reloads(monkeypatch)
    model = load_model("tiny", str(tmp_path / "build"))
    publish = tmp_path / "elsewhere" / "published"  # outside the workdir's tree
    cfg = load_config(RLRecipeConfig, None, [*OVERRIDES, f"paths.workdir={tmp_path / 'run'}",
                                             f"paths.publish={publish}", "eval.num_tasks=2",
                                             "log.report_files=true"])
    report = rl(model, ParityEnv(), cfg).report
    assert report["steps"] == 1 and report["published"] == str(publish)
    first_before = report["eval"]["before"]
    assert sorted(os.listdir(publish)) == ["1"]  # the weights after update 1
    assert not os.path.exists(tmp_path / "run" / "published")
    metrics = [json.loads(x) for x in open(tmp_path / "run" / "metrics" / "metrics.jsonl")]
    assert metrics[0]["train/skipped_update"] == 0.0 and metrics[0]["train/grad_norm"] > 0
    assert os.path.isdir(tmp_path / "run" / "metrics" / "tensorboard")
    saved = json.load(open(tmp_path / "run" / "report" / "config.json"))
    assert saved["rl"]["steps"] == 1 and saved["paths"]["publish"] == str(publish)

    # Resume (asked for: issue 68, finding 3): the same workdir with two steps trains only
    # the second, and the console says where it resumed and what changed.
    cfg2 = dataclasses.replace(cfg, rl=dataclasses.replace(cfg.rl, steps=2),
                               paths=dataclasses.replace(cfg.paths, existing="resume"),
                               log=dataclasses.replace(cfg.log, progress=True))
    recipe = importlib.import_module("ac2_jax.recipes._rl")
    console = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recipe, "Progress", functools.partial(recipe.Progress, out=console))
        report = rl(model, ParityEnv(), cfg2).report
    (line,) = [x for x in console.getvalue().splitlines() if "resuming" in x]
    assert line.startswith("[rl] resuming at step 1 (changed: ") and "rl.steps 1 -> 2" in line
    # The report covers the whole run (issue 68, finding 3): both steps, each invocation;
    # eval-before is the run's start's (the resumed model is not the base), never re-run.
    assert report["steps"] == 2 and report["steps_this_run"] == 1
    assert [(i["from_step"], i["steps"]) for i in report["invocations"]] == [(0, 1), (1, 1)]
    assert report["eval"]["before"] == first_before
    assert report["eval"]["before_step"] == 0 and "ci95" in report["eval"]["improvement"]
    (kept,) = [x for x in console.getvalue().splitlines() if "eval before" in x]
    assert "kept from the run's start (step 0)" in kept, kept
    traces = TraceStore(str(tmp_path / "run" / "traces" / "rollouts.jsonl")).read()
    keys = [(t.metadata["rl_step"], t.task_id, t.metadata["attempt"]) for t in traces]
    assert len(keys) == len(set(keys)) == 2 * 2 * 4  # two steps, no rollout run twice
    assert sorted(os.listdir(publish)) == ["1", "2"]
    # The report's files (issue 68, finding 10): the curve over both invocations' steps
    # and the last step's first attempts as trace pages.
    folder = tmp_path / "run" / "report"
    assert (folder / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert report["pages"] == [str(folder / "trace_0.html"), str(folder / "trace_1.html")]
    assert "<html" in (folder / "trace_0.html").read_text()
    assert reloads == []


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


def test_rl_with_lora_trains_and_publishes_the_adapters_only(tmp_path, monkeypatch):
    """`lora.rank=4`: the optimizer holds the adapters only (the base is frozen:
    unchanged after the step), each publish carries the adapters alone, and the
    export is the merged HF checkpoint plus the adapter in PEFT's format. Through
    `sampler.hand_off=disk`: the sampler reloads the publish (version 1)."""
    import jax
    import numpy as np
    from flax import nnx

    from ac2_jax.models.io.hf_io import load_hf_checkpoint
    from ac2_jax.models.io.peft_io import read_peft_config

    model, tok = load_model("tiny", str(tmp_path / "build"))
    base = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    cfg = load_config(RLRecipeConfig, None, [*OVERRIDES, f"paths.workdir={tmp_path / 'run'}",
                                             "lora.rank=4", "lora.alpha=8",
                                             "rl.optimizer.learning_rate=1e-2",
                                             "sampler.hand_off=disk"])
    reloads = _count_reloads(monkeypatch)
    result = rl((model, tok), ParityEnv(), cfg)
    assert reloads == [1]
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


def _rl_run(tmp_path, monkeypatch, *overrides) -> io.StringIO:
    """An RL run whose console lines (its `Progress`) go to the StringIO returned."""
    recipe = importlib.import_module("ac2_jax.recipes._rl")

    console = io.StringIO()
    monkeypatch.setattr(recipe, "Progress", functools.partial(recipe.Progress, out=console))
    cfg = load_config(RLRecipeConfig, None, [*OVERRIDES, "rl.attempts_per_task=2",
                                             "log.progress=true", *overrides,
                                             f"paths.workdir={tmp_path / 'run'}"])
    try:
        rl(load_model("tiny", str(tmp_path / "build")), ParityEnv(), cfg)
    except Exception as e:
        e.console = console.getvalue()
        raise
    return console


def test_cut_trained_tokens_are_said_on_the_console_once_per_step(tmp_path, monkeypatch):
    # Issue 68, finding 1: with rows too short for the traces, most trained tokens were
    # cut; the counter sat in metrics.jsonl and the console said nothing.
    err = _rl_run(tmp_path, monkeypatch, "rl.batch.seq_len=16", "rl.batch.max_seq_len=16",
                  "rl.steps=2").getvalue()
    metrics = [json.loads(x) for x in open(tmp_path / "run" / "metrics" / "metrics.jsonl")]
    lines = [x for x in err.splitlines() if "trained tokens cut" in x]
    assert len(lines) == 2, err  # one per step
    for line, m in zip(lines, metrics):
        cut = int(m["train/truncated_agent_tokens"])
        kept = sum(int(v) for k, v in m.items() if k.startswith("train/trained_tokens/"))
        assert cut > 0 and f"step {m['train/rl_step'] + 1:.0f}: {cut} of {cut + kept} " in line
        assert "rl.batch.max_seq_len=16" in line
    assert all(len(x) <= 120 for x in err.splitlines())
    # The no-update note names the cut, not tied rewards.
    assert "rewards tied" not in err, err


def test_a_context_below_the_prompt_stops_the_run_naming_the_error(tmp_path, monkeypatch):
    # Issue 68, finding 2: with sampler.max_context below the prompt every attempt was
    # agent_error (a 400 in the trace's metadata) and the console said "no update: ...
    # every group's rewards tied". Now the console gives the count and the first
    # error, and a step whose every attempt failed the same way without one model
    # answer stops the run with that reason.
    from ac2_jax.config import ConfigError

    with pytest.raises(ConfigError) as e:
        _rl_run(tmp_path, monkeypatch, "sampler.max_context=16")
    message = str(e.value)
    assert "every attempt of rl step 1 (4 of 4) failed" in message
    assert "maximum context length is 16 tokens" in message
    assert "sampler.max_context=16" in message
    err = e.value.console
    assert "4 of 4 attempts ended agent_error" in err and "maximum context length" in err
    assert "rewards tied" not in err, err
    assert all(len(x) <= 120 for x in err.splitlines())
