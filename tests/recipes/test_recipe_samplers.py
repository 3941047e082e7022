"""The RL recipe on remote samplers by config (`sampler.kind`): SGLang and a fleet.

SGLang needs CUDA, so the servers are `sglang_fake.FakeSGLang`, the local
reproduction of SGLang's HTTP API (its own tiny model, the same weights as the
policy's), over real HTTP. The fleet's run is test_recipe_rl's (same model and
batch shapes, so the suite's compilation cache serves its train step): every
attempt is sampled by the servers, and the step's publish is exported as HF
safetensors and hot-swapped into each of them (`/update_weights_from_disk`).
Kind "sglang" (one such client) is checked by config without a training step.
"""

import dataclasses
import os
import zlib

import numpy as np
import pytest

from ac2_jax.config_cli import load_config
from ac2_jax.recipes import RLRecipeConfig, load_model, rl
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.trace import TraceStore
from tests.support.recipe_helpers import ParityEnv
from tests.support.sglang_fake import FakeSGLang

OVERRIDES = ["rl.steps=1", "rl.tasks_per_step=2", "rl.attempts_per_task=4", "rl.batch.rows=2",
             "rl.batch.seq_len=128", "rl.concurrency=8", "rollout.max_tokens=8",
             "rollout.max_steps=1", "log.progress=false", "log.report_files=false",
             "log.tensorboard=false"]  # test_recipe_rl's run
CONTEXT = 1024  # the tiny preset's (SGLang's --context-length)


class SeededSampler(JaxSampler):
    """A JaxSampler that seeds each unseeded request by its prompt and how many times
    that prompt was asked before (`asked`, shared by a fleet's servers), not by a draw
    in arrival order: the 8 concurrent rollouts arrive in an order the threads decide,
    and with draws a group's rewards depended on it, so about one run in 64 had every
    group of one reward (no advantage: no update, no publish for the asserts below).
    Seeded so, a task's attempts get the same completions however they interleave or
    whichever backend serves them (the servers' weights are the same)."""

    def __init__(self, *args, asked, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked = asked

    async def generate(self, prompt_ids, params=None, *, on_tokens=None):
        if params is not None and params.seed is None:
            prompt = tuple(int(t) for t in prompt_ids)
            nth = self.asked[prompt] = self.asked.get(prompt, -1) + 1
            seed = zlib.crc32(np.asarray([*prompt, nth], np.int64).tobytes())
            params = dataclasses.replace(params, seed=seed)
        return await super().generate(prompt_ids, params, on_tokens=on_tokens)


class Server(FakeSGLang):
    """FakeSGLang whose sampler decodes as the recipe's embedded one would (8 rows),
    seeded by prompt (`SeededSampler`)."""

    def __init__(self, *args, asked, **kwargs):
        self.asked = asked
        super().__init__(*args, **kwargs)

    def _sampler(self, model):
        return SeededSampler(model, max_context=self.context_len, tokenizer=self.tok,
                             max_batch=8, asked=self.asked)


@pytest.fixture
def servers(tmp_path):
    """start(n): n servers of the tiny preset's weights -> their URLs; all stopped after."""
    running, asked = [], {}

    def start(n):
        for i in range(n):
            model, tok = load_model("tiny", str(tmp_path / f"server{i}"))
            fake = Server(model, tok, context_len=CONTEXT, asked=asked)
            url, stop = serve_in_thread(fake.app)
            running.append((fake, url, stop))
        return [url for _, url, _ in running]

    yield start, running
    for fake, _, stop in running:
        stop()
        fake.close()


def _run(tmp_path, *overrides):
    cfg = load_config(RLRecipeConfig, None, [*OVERRIDES, f"paths.workdir={tmp_path / 'run'}",
                                             *overrides])
    pair = load_model("tiny", str(tmp_path / "build"))
    report = rl(pair, ParityEnv(), cfg).report
    traces = TraceStore(str(tmp_path / "run" / "traces" / "rollouts.jsonl")).read()
    return report, traces


def _generates(fake):
    return [body for what, body in fake.log if what == "generate"]


def _updates(fake):
    return [body for what, body in fake.log if what == "update_end"]


def test_sglang_by_config_serves_and_exports_each_publish(servers, tmp_path):
    """sampler.kind=sglang from the recipe's config: `serve_policy` (every recipe's
    endpoint) serves an `SGLangSampler` of the server at sampler.url, and a publish is
    exported under workdir/exports and loaded there (what the recipe's on_publish
    does). The RL recipe end to end over SGLang clients is the fleet test's run below
    (a fleet is one such client per backend, built by the same code): one recipe run
    for both kinds, not two (the suite's time)."""
    import asyncio

    import httpx

    from ac2_jax.models.io.params_io import publish_weights
    from ac2_jax.recipes.common import serve_policy
    from ac2_jax.sampling.remote.sglang import SGLangSampler

    start, running = servers
    (url,) = start(1)
    (fake, _, _) = running[0]
    cfg = load_config(RLRecipeConfig, None, [*OVERRIDES, f"paths.workdir={tmp_path / 'run'}",
                                             "sampler.kind=sglang", f"sampler.url={url}"])
    paths = cfg.paths.resolved()
    model, tok = load_model("tiny", str(tmp_path / "build"))

    async def serve():
        async with serve_policy(model, tok, publish_dir=paths.publish, traces_dir=paths.traces,
                                sampler=cfg.sampler, rollout=cfg.rollout,
                                max_batch=8) as (sampler, lifecycle):
            assert isinstance(sampler, SGLangSampler)
            # A completion through the endpoint comes from the server (one /generate).
            rollout = await lifecycle.create(task_id="t")
            async with httpx.AsyncClient(timeout=60) as client:
                r = await client.post(rollout["base_url"] + "/completions", json={
                    "model": cfg.sampler.model_name, "prompt": "Say a word.", "max_tokens": 4},
                    headers={"Authorization": f"Bearer {rollout['api_key']}"})
            assert r.status_code == 200, r.text
            assert len(_generates(fake)) == 1
            publish_weights(model, paths.publish, 1)
            return await asyncio.to_thread(sampler.load_weights, 1)

    assert asyncio.run(serve()) == 1
    (update,) = _updates(fake)  # exported beside the publish folder, loaded as version 1
    assert update["weight_version"] == "1" and fake.version == "1"
    assert update["model_path"] == os.path.join(tmp_path, "run", "exports", "step_1")
    assert os.path.exists(os.path.join(update["model_path"], "config.json"))


def test_rl_recipe_samples_on_a_fleet_by_config(servers, tmp_path):
    start, running = servers
    urls = start(2)
    report, traces = _run(tmp_path, "sampler.kind=fleet", f"sampler.backends={','.join(urls)}")
    fakes = [fake for fake, _, _ in running]
    assert report["steps"] == 1 and len(traces) == 8
    assert {t.status for t in traces} <= {"finished", "agent_error"}, [t.status for t in traces]
    sampled = [len(_generates(f)) for f in fakes]
    assert sum(sampled) == sum(len(t.episodes) for t in traces)
    assert min(sampled) > 0, sampled  # 8 concurrent rollouts spread over both backends
    for i, fake in enumerate(fakes):  # the publish reached each, from its own export
        (update,) = _updates(fake)
        assert update["weight_version"] == "1" and fake.version == "1"
        assert update["model_path"] == os.path.join(tmp_path, "run", "exports", f"backend{i}",
                                                    "step_1")
