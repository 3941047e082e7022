"""The distillation recipe: hinted rollouts through the endpoint, OPSD and RMSD steps."""

import json
import os

import pytest

from ac2_jax.config_cli import load_config
from ac2_jax.recipes import DistillRecipeConfig, distill, load_model
from tests.support.recipe_helpers import ParityEnv

SMALL = ["loop.steps=1", "loop.tasks_per_step=2", "loop.concurrency=4", "rollout.max_tokens=8",
         "rollout.max_steps=1", "sampler.warmup=false", "log.progress=false",
         "log.report_files=false"]  # on where a test checks them


def test_opsd_distills_hinted_traces_and_resumes(tmp_path):
    model = load_model("tiny", str(tmp_path / "build"))
    cfg = load_config(DistillRecipeConfig, None, [*SMALL, f"paths.workdir={tmp_path / 'run'}",
                                                  "log.report_files=true"])
    r = distill(model, ParityEnv(), cfg).report
    assert r["steps"] == 1 and r["skipped_steps"] == 0
    # The report's files (issue 68, finding 10): curve, trace pages and the heatmap of
    # the last step's first example (teacher-student divergence per response token).
    folder = tmp_path / "run" / "report"
    assert (folder / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert r["pages"] == [str(folder / "trace_0.html"), str(folder / "trace_1.html")]
    assert r["heatmap"] == str(folder / "distill_report.html")
    page = (folder / "distill_report.html").read_text()
    assert "teacher-student divergence" in page and "Answer with an even number" in page
    m = {}
    for line in open(tmp_path / "run" / "metrics" / "metrics.jsonl"):
        m.update(json.loads(line))  # the step's train/ and data/ lines
    assert m["step"] == 1 and m["train/kept_tokens"] > 0
    assert m["data/examples"] == 2 and m["data/skipped_traces"] == 0
    assert m["data/infra_error_traces"] == 0
    # Resume: a second step on the same workdir trains only step 2.
    cfg2 = load_config(DistillRecipeConfig, None, [*SMALL, "loop.steps=2", "paths.existing=resume",
                                                   f"paths.workdir={tmp_path / 'run'}"])
    r2 = distill(model, ParityEnv(), cfg2).report
    # The report covers the whole run (issue 68, finding 3).
    assert r2["steps"] == 2 and r2["steps_this_run"] == 1 and len(r2["invocations"]) == 2


def test_a_step_with_nothing_kept_makes_no_update_and_says_so(tmp_path):
    # RMSD with a keyword judge: the toy answers hold none of the hint's words.
    model = load_model("tiny", str(tmp_path / "build"))
    cfg = load_config(DistillRecipeConfig, None, [*SMALL, "distill.method=rmsd",
                                                  f"paths.workdir={tmp_path / 'run'}"])
    r = distill(model, ParityEnv(), cfg).report
    assert r["skipped_steps"] == r["steps"] == 1


def test_opsd_with_lora_trains_the_adapters_only(tmp_path):
    import numpy as np
    from flax import nnx
    model, tok = load_model("tiny", str(tmp_path / "build"))
    base = {k: np.asarray(v[...]) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    cfg = load_config(DistillRecipeConfig, None, [*SMALL, f"paths.workdir={tmp_path / 'run'}",
                                                  "lora.rank=4", "optimizer.learning_rate=1e-2"])
    result = distill((model, tok), ParityEnv(), cfg)
    assert result.report["steps"] == 1 and "adapter" in result.report
    final = result.model
    moved = 0
    for key, var in nnx.to_flat_state(nnx.state(final, nnx.Param)):
        if isinstance(var, nnx.LoRAParam):
            moved += int(np.abs(np.asarray(var[...])).max() > 0 and key[-1] == "b")
        else:
            np.testing.assert_array_equal(np.asarray(var[...]), base[key])
    assert moved > 0


def test_only_failures_distills_the_failed_attempts_and_counts_the_passed(tmp_path):
    """Data path (c): the verifier grades every attempt; the passed ones are counted
    (data/passed_traces) and never taught, every failed one becomes an example."""
    from ac2_jax.trace import TraceStore

    model = load_model("tiny", str(tmp_path / "build"))
    cfg = load_config(DistillRecipeConfig, None, [
        *SMALL, "loop.tasks_per_step=4", "loop.attempts_per_task=2", "loop.only_failures=true",
        "rollout.temperature=1.0", f"paths.workdir={tmp_path / 'run'}"])
    distill(model, ParityEnv(), cfg)
    m = {}
    for line in open(tmp_path / "run" / "metrics" / "metrics.jsonl"):
        m.update(json.loads(line))
    traces = list(TraceStore(str(tmp_path / "run" / "traces" / "rollouts.jsonl")).read())
    passed = sum(t.reward is not None and t.reward >= 1.0 for t in traces)
    assert len(traces) == 8 and 0 < passed < 8  # both kinds (a random policy, seed 0)
    assert m["data/passed_traces"] == passed
    assert m["data/examples"] == 8 - passed  # one completion per single-turn attempt


def test_only_failures_on_a_multi_turn_env_distills_every_turn_of_the_failed_games(tmp_path):
    """Data path (c) on a multi-turn env: GuessEnv answers each guess through the
    rollout (`EnvUser`), so each attempt is one episode of several requests through the
    endpoint; the failed games are hinted with the secret and every turn's output is
    distilled, once."""
    from ac2_jax.envs import GuessEnv
    from ac2_jax.trace import TraceStore

    model = load_model("tiny", str(tmp_path / "build"))
    cfg = load_config(DistillRecipeConfig, None, [
        *SMALL, "loop.tasks_per_step=3", "loop.attempts_per_task=2", "loop.only_failures=true",
        "rollout.max_steps=3", "rollout.temperature=1.0", f"paths.workdir={tmp_path / 'run'}"])
    env = GuessEnv(highs=(7,), max_guesses=3)
    distill(model, env, cfg)
    m = {}
    for line in open(tmp_path / "run" / "metrics" / "metrics.jsonl"):
        m.update(json.loads(line))
    traces = list(TraceStore(str(tmp_path / "run" / "traces" / "rollouts.jsonl")).read())
    failed = [t for t in traces if not t.reward]
    assert len(traces) == 6 and m["data/passed_traces"] == 6 - len(failed) and failed
    turns = [len(t.episodes[0].completions) for t in failed]
    assert all(len(t.episodes) == 1 for t in failed) and min(turns) >= 2  # multi-turn
    outputs = sum(len(c.output_ids) for t in failed for c in t.episodes[0].completions)
    # The default placement, before_turn, moves the hint with each request: one example
    # per turn (a placement that stays put would merge each episode into one).
    assert m["data/examples"] == sum(turns)
    assert m["train/kept_tokens"] == outputs  # every output token of every turn, once


def test_a_context_below_the_prompt_stops_distillation_naming_the_error(tmp_path):
    # Issue 68, finding 2, in the distillation recipe: every attempt failed with the
    # endpoint's 400 and the run went on distilling nothing. Now it stops, before any
    # update, with the error and the setting to change.
    from ac2_jax.config import ConfigError

    cfg = load_config(DistillRecipeConfig, None, [*SMALL, "sampler.max_context=16",
                                                  f"paths.workdir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"every attempt of distill step 1 \(2 of 2\) failed "
                                          r".*maximum context length is 16.*sampler.max_context=16"):
        distill(load_model("tiny", str(tmp_path / "build")), ParityEnv(), cfg)
    assert not os.path.exists(tmp_path / "run" / "distill" / "checkpoints" / "1")
