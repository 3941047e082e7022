"""The eval recipe: a model's held-out pass rate with its CI, nothing trained."""

import json

import pytest

from ac2_jax.config import ConfigError
from ac2_jax.config_cli import load_config
from ac2_jax.recipes import RECIPES, EvalRecipeConfig, eval_model, load_model
from tests.support.recipe_helpers import ParityEnv

pytestmark = pytest.mark.full  # a recipe end to end (the endpoint over a sampler)


def test_eval_reports_the_pass_rate_with_its_ci_and_every_attempt(tmp_path):
    # Issue 68, finding 10: there was no eval-only command for one's own env.
    assert RECIPES["eval"] == (EvalRecipeConfig, eval_model)
    cfg = load_config(EvalRecipeConfig, None, [
        f"paths.workdir={tmp_path / 'run'}", "eval.num_tasks=4", "eval.attempts=2",
        "eval.temperature=1.0", "rollout.max_tokens=8", "rollout.max_steps=1",
        "sampler.warmup=false", "log.progress=false"])
    model = load_model("tiny", str(tmp_path / "build"))
    # A training run's files in the workdir, and a page of an earlier, larger eval (review
    # of issue 68: eval appended to the run's served.jsonl and left stale eval pages).
    (tmp_path / "run" / "traces").mkdir(parents=True)
    (tmp_path / "run" / "report").mkdir()
    (tmp_path / "run" / "traces" / "served.jsonl").write_text('{"the": "run"}\n')
    (tmp_path / "run" / "report" / "trace_0.html").write_text("the run's page")
    (tmp_path / "run" / "report" / "eval_trace_5.html").write_text("an earlier eval's page")
    out = eval_model(model, ParityEnv(), cfg)
    report, folder = out.report, tmp_path / "run" / "report"
    assert json.loads((folder / "eval_report.json").read_text()) == report
    assert report["tasks"] == 4 and report["attempts"] == 2
    low, high = report["pass_rate_ci95"]
    assert 0.0 <= low <= report["pass_rate"] <= high <= 1.0
    assert report["pass_rate"] == out.evals["eval"].pass_rate.mean
    attempts = json.loads((folder / "eval_attempts.json").read_text())
    assert len(attempts) == 8 and {a["task_id"] for a in attempts} == {
        t.task_id for t in ParityEnv().sample_tasks(4, 0, "eval")}
    assert report["pages"] == [str(folder / "eval_trace_0.html"), str(folder / "eval_trace_1.html")]
    assert not (folder / "eval_trace_5.html").exists()  # the stale page of an earlier eval
    assert (folder / "trace_0.html").read_text() == "the run's page"
    traces = tmp_path / "run" / "traces"
    assert (traces / "served.jsonl").read_text() == '{"the": "run"}\n'  # the run's, untouched
    served = (traces / "eval_served.jsonl").read_text().splitlines()
    assert len(served) >= 8  # eval's own trace store: its 8 attempts (at least)
    assert not (folder / "report.json").exists()  # nothing trained, no training report
    with pytest.raises(ConfigError, match="eval.num_tasks >= 1"):
        eval_model(model, ParityEnv(), load_config(EvalRecipeConfig, None, ["eval.num_tasks=0"]))
    with pytest.raises(ConfigError, match="claims no workdir"):
        eval_model(model, ParityEnv(), load_config(EvalRecipeConfig, None,
                                                   ["paths.existing=resume"]))
