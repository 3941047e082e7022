"""The distillation recipe with a teacher model (distill.teacher = a preset / HF dir)."""

import json

import pytest

from ac2_jax.config import ConfigError
from ac2_jax.config_cli import load_config
from ac2_jax.recipes import DistillRecipeConfig, distill, load_model
from tests.support.recipe_helpers import ParityEnv

pytestmark = pytest.mark.full  # a recipe end to end

SMALL = ["loop.steps=1", "loop.tasks_per_step=2", "loop.concurrency=4", "rollout.max_tokens=8",
         "rollout.max_steps=1", "sampler.warmup=false", "log.progress=false"]


class NoHintEnv(ParityEnv):
    hint = None  # plain OPD needs no hint()


def test_plain_opd_from_a_teacher_model_without_hints(tmp_path):
    """distill.teacher=tiny (a preset, bf16) with loop.hints=false: every trace is
    taught (no hint needed), the report names the teacher."""
    model = load_model("tiny", str(tmp_path / "build"))
    cfg = load_config(DistillRecipeConfig, None, [
        *SMALL, "distill.teacher=tiny", "distill.teacher_dtype=bfloat16", "loop.hints=false",
        f"paths.workdir={tmp_path / 'run'}"])
    r = distill(model, NoHintEnv(), cfg).report
    assert r["steps"] == 1 and r["skipped_steps"] == 0 and r["teacher"] == "tiny"
    m = {}
    for line in open(tmp_path / "run" / "metrics" / "metrics.jsonl"):
        m.update(json.loads(line))
    assert m["data/examples"] == 2 and m["data/traces_without_hints"] == 2
    assert m["train/kept_tokens"] > 0


def test_hints_off_with_the_self_teacher_is_refused(tmp_path):
    cfg = load_config(DistillRecipeConfig, None, [*SMALL, "loop.hints=false",
                                                  f"paths.workdir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match="loop.hints=false needs distill.teacher"):
        distill("tiny", ParityEnv(), cfg)
